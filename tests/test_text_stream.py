from tierflow.runtime.text.text_stream import TextStream


def test_multibyte_character_split_across_tokens_is_released_whole():
    stream = TextStream()
    encoded = "é😀".encode()
    pieces = [stream.push(encoded[i:i + 1]) for i in range(len(encoded))]
    assert "".join(pieces) == "é😀"
    assert all(len(p) <= 1 for p in pieces)  # never half a character


def test_stop_string_cuts_the_text_and_marks_stopped():
    stream = TextStream(stop=["END"])
    pieces = [stream.push(b) for b in (b"hello E", b"N", b"D and more")]
    assert "".join(pieces) + stream.flush() == "hello "
    assert stream.stopped


def test_text_that_only_looks_like_a_stop_prefix_is_released_later():
    stream = TextStream(stop=["END"])
    assert stream.push(b"a E") == "a "
    assert stream.push(b"x") == "Ex"
    assert not stream.stopped


def test_flush_releases_held_back_tail_at_the_end():
    stream = TextStream(stop=["###"])
    assert stream.push(b"done #") == "done "
    assert stream.flush() == "#"
    assert stream.text == "done #"
