"""llama-server's extras on the real server: /tokenize, /detokenize and /props, against the engine."""

import httpx


def test_tokenize_gives_the_engines_ids_and_their_pieces(url, engine):
    ids = engine.tokenize("The capital of France", add_bos=False, parse_special=True)
    assert httpx.post(f"{url}/tokenize", json={"content": "The capital of France"}).json() == {"tokens": ids}
    pieces = httpx.post(f"{url}/tokenize", json={"content": "The capital", "with_pieces": True}).json()
    assert "".join(token["piece"] for token in pieces["tokens"]) == "The capital"


def test_detokenize_turns_ids_back_into_the_text(url, engine):
    ids = engine.tokenize("Paris is lovely", add_bos=False)
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"content": "Paris is lovely"}


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_the_tokens(url, engine):
    reply = httpx.post(f"{url}/detokenize", json={"tokens": [engine.config.vocab_size + 5]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"


def test_tokenize_without_content_is_a_400_naming_it(url):
    reply = httpx.post(f"{url}/tokenize", json={"with_pieces": True})
    assert reply.status_code == 400 and "content" in reply.json()["error"]["message"]


def test_props_tell_the_slots_the_context_and_the_template(url, engine):
    props = httpx.get(f"{url}/props").json()
    assert props["total_slots"] == engine.parallel
    assert props["chat_template"] == engine.tokenizer.template.jinja
    assert props["default_generation_settings"]["n_ctx"] == engine.context_length
