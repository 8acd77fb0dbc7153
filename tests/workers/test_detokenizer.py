"""Incremental detokenization: stop strings held back and cut, multi-byte characters, flush."""

from __future__ import annotations

import pytest

from contract.request import GenerationRequest, SamplingParams
from workers.detokenizer import IncrementalDetokenizer

TEXT = "Hello world, this is the end."


@pytest.fixture(scope="module")
def ids(smollm_tokenizer) -> list[int]:
    ids = smollm_tokenizer.encode(TEXT, add_special_tokens=False)
    # the cases below rely on this split: "Hello", " world", ",", " this", " is", " the", ...
    assert [smollm_tokenizer.decode([i]) for i in ids] == [
        "Hello", " world", ",", " this", " is", " the", " end", "."]
    return ids


def feed(tokenizer, token_ids: list[int], stop: list[str],
         include_stop: bool = False) -> tuple[list[str], bool, str]:
    detok = IncrementalDetokenizer(tokenizer, stop, include_stop=include_stop)
    deltas = [detok.add(t) for t in token_ids]
    return deltas, detok.stopped, detok.flush()


def test_no_stop_strings_streams_every_token(smollm_tokenizer, ids):
    deltas, stopped, tail = feed(smollm_tokenizer, ids, [])
    assert deltas == ["Hello", " world", ",", " this", " is", " the", " end", "."]
    assert (stopped, tail) == (False, "")


def test_stop_string_split_across_tokens_is_held_back_and_cut(smollm_tokenizer, ids):
    # ", this" spans the "," token and the " this" token
    deltas, stopped, tail = feed(smollm_tokenizer, ids, [", this"])
    assert deltas == ["Hello", " world", "", "", "", "", "", ""]
    assert (stopped, tail) == (True, "")
    assert "".join(deltas) == "Hello world"


def test_partial_stop_match_inside_a_token_is_cut_mid_token(smollm_tokenizer, ids):
    # "s is t" starts inside " this" and ends inside " the"
    deltas, stopped, tail = feed(smollm_tokenizer, ids, ["s is t"])
    assert deltas == ["Hello", " world", ",", " thi", "", "", "", ""]
    assert (stopped, "".join(deltas) + tail) == (True, "Hello world, thi")


def test_held_back_prefix_is_released_when_the_stop_does_not_follow(smollm_tokenizer, ids):
    deltas, stopped, tail = feed(smollm_tokenizer, ids, [", that"])
    assert deltas == ["Hello", " world", "", ", this", " is", " the", " end", "."]
    assert (stopped, tail) == (False, "")
    assert "".join(deltas) == TEXT


def test_flush_returns_the_held_back_tail_only_without_a_stop(smollm_tokenizer, ids):
    deltas, stopped, tail = feed(smollm_tokenizer, ids[:7], [" end."])
    assert deltas == ["Hello", " world", ",", " this", " is", " the", ""]
    assert (stopped, tail) == (False, " end")
    detok = IncrementalDetokenizer(smollm_tokenizer, [" end."])
    for token in ids:
        detok.add(token)
    assert detok.stopped
    assert detok.flush() == ""
    assert detok.add(ids[0]) == ""  # nothing after a stop


def test_earliest_of_several_stop_strings_wins(smollm_tokenizer, ids):
    deltas, stopped, _ = feed(smollm_tokenizer, ids, [" the end", "world"])
    assert stopped
    assert "".join(deltas) == "Hello "


def test_stop_string_at_the_very_start_emits_nothing(smollm_tokenizer, ids):
    deltas, stopped, tail = feed(smollm_tokenizer, ids, ["Hello"])
    assert deltas == [""] * len(ids)
    assert (stopped, tail) == (True, "")


def test_an_included_stop_string_ends_the_text_and_nothing_is_held_back(smollm_tokenizer, ids):
    # ", this" spans two tokens: excluded, "," waits to see whether " this" follows
    deltas, stopped, tail = feed(smollm_tokenizer, ids, [", this"], include_stop=True)
    assert deltas == ["Hello", " world", ",", " this", "", "", "", ""]
    assert (stopped, tail) == (True, "")
    # a match ending inside a token cuts that token after the match
    deltas, stopped, tail = feed(smollm_tokenizer, ids, ["s is t"], include_stop=True)
    assert deltas == ["Hello", " world", ",", " this", " is", " t", "", ""]
    assert (stopped, "".join(deltas) + tail) == (True, "Hello world, this is t")


def test_an_included_stop_is_the_earliest_then_the_longest(smollm_tokenizer, ids):
    deltas, stopped, _ = feed(smollm_tokenizer, ids, ["the end", "is", "is the"],
                              include_stop=True)
    assert (stopped, "".join(deltas)) == (True, "Hello world, this")  # "is" in "this"
    deltas, _, _ = feed(smollm_tokenizer, ids, [" is", " is the"], include_stop=True)
    assert "".join(deltas) == "Hello world, this is"  # " is the" is not complete yet
    deltas, _, _ = feed(smollm_tokenizer, ids, [" t", " th"], include_stop=True)
    assert "".join(deltas) == "Hello world, th"  # both complete in " this": the longer


def test_an_included_stop_string_respects_min_tokens(smollm_tokenizer, ids):
    detok = IncrementalDetokenizer(smollm_tokenizer, ["is"], min_tokens=4, include_stop=True)
    text = "".join(detok.add(t) for t in ids)
    assert (detok.stopped, text) == (True, "Hello world, this is")  # "this" was in min_tokens


def test_multi_byte_characters_are_emitted_only_when_complete(smollm_tokenizer):
    text = "I love 🦀 and 日本語!"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    deltas, stopped, tail = feed(smollm_tokenizer, ids, [])
    assert deltas == ["I", " love", "", "", " 🦀", " and", "", "", " 日", "本", "", "", "語",
                      "!"]
    assert "".join(deltas) + tail == text
    assert not any("\ufffd" in d for d in deltas)
    assert not stopped


def test_stop_string_made_of_a_multi_byte_character(smollm_tokenizer):
    ids = smollm_tokenizer.encode("I love 🦀 and 日本語!", add_special_tokens=False)
    deltas, stopped, tail = feed(smollm_tokenizer, ids, ["🦀"])
    assert (stopped, "".join(deltas) + tail) == (True, "I love ")
    deltas, stopped, tail = feed(smollm_tokenizer, ids, ["本語"])
    assert (stopped, "".join(deltas) + tail) == (True, "I love 🦀 and 日")


def test_special_tokens_produce_no_text(smollm_tokenizer, ids):
    im_end = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    deltas, _, _ = feed(smollm_tokenizer, [ids[0], im_end, ids[1]], [])
    assert deltas == ["Hello", "", " world"]


def test_engine_cuts_a_stop_string_and_reports_stop(smollm, make_engine):
    """The engine end to end: greedy " Paris.\\n\\nThe answer ..." stops before "\\n\\nThe"."""
    prompt = smollm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    engine = make_engine(smollm, num_blocks=8)
    chunks = engine.generate([
        GenerationRequest("stop-str", prompt, SamplingParams(
            temperature=0.0, max_tokens=16, stop=["\n\nThe"])),
        GenerationRequest("stop-id", prompt, SamplingParams(
            temperature=0.0, max_tokens=16, stop_token_ids=[30])),  # 30 is "."
    ])
    by_string = chunks["stop-str"]
    assert [t for c in by_string for t in c.token_ids] == [7042, 30, 198, 198, 504]
    assert [c.text for c in by_string] == [" Paris", ".", "", "", ""]
    assert by_string[-1].finish_reason == "stop"
    assert [c.finish_reason for c in by_string[:-1]] == [None] * 4
    assert [c.stop_reason for c in by_string] == [None] * 4 + ["\n\nThe"]
    assert by_string[-1].completion_tokens == 5
    by_id = chunks["stop-id"]
    assert [t for c in by_id for t in c.token_ids] == [7042, 30]
    assert "".join(c.text for c in by_id) == " Paris"
    assert (by_id[-1].finish_reason, by_id[-1].stop_reason) == ("stop", 30)
    assert engine.pool.num_in_use == 0


def test_stop_reason_is_none_for_eos_and_length_and_the_id_of_a_requested_eos(smollm,
                                                                              make_engine):
    """vLLM's ``stop_reason``: the model's EOS ends with None, unless ``ignore_eos`` made it
    a requested stop token like any other; ``max_tokens`` ends with None."""
    prompt = smollm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    eos = smollm.tokenizer.eos_token_id
    forced = {eos: 100.0}  # the first token is EOS
    engine = make_engine(smollm, num_blocks=8)
    chunks = engine.generate([
        GenerationRequest("eos", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                        logit_bias=forced)),
        GenerationRequest("eos-asked", prompt, SamplingParams(
            temperature=0.0, max_tokens=4, logit_bias=forced, ignore_eos=True,
            stop_token_ids=[eos])),
        GenerationRequest("length", prompt, SamplingParams(temperature=0.0, max_tokens=2)),
    ])
    ends = {rid: ([t for c in cs for t in c.token_ids], cs[-1].finish_reason, cs[-1].stop_reason)
            for rid, cs in chunks.items()}
    assert ends == {"eos": ([eos], "stop", None), "eos-asked": ([eos], "stop", eos),
                    "length": ([7042, 30], "length", None)}
    assert engine.pool.num_in_use == 0


def test_the_matched_stop_string_is_recorded(smollm_tokenizer, ids):
    """Of "world" and "wor", complete at the same token and starting at the same offset, the
    longer is the match."""
    detok = IncrementalDetokenizer(smollm_tokenizer, [" the end", "wor", "world"])
    assert [detok.add(t) for t in ids[:2]] == ["Hello", " "]
    assert (detok.stopped, detok.matched) == (True, "world")
    unstopped = IncrementalDetokenizer(smollm_tokenizer, ["nowhere"])
    for t in ids:
        unstopped.add(t)
    assert (unstopped.stopped, unstopped.matched) == (False, None)


def test_engine_returns_an_included_stop_string(smollm, make_engine):
    """``include_stop_str_in_output``: the same greedy tokens, the text up to and with
    "\n\nThe"."""
    prompt = smollm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    engine = make_engine(smollm, num_blocks=8)
    chunks = engine.generate([GenerationRequest("stop-incl", prompt, SamplingParams(
        temperature=0.0, max_tokens=16, stop=["\n\nThe"], include_stop_str_in_output=True))])
    chunks = chunks["stop-incl"]
    assert [t for c in chunks for t in c.token_ids] == [7042, 30, 198, 198, 504]
    assert [c.text for c in chunks] == [" Paris", ".", "\n", "\n", "The"]
    assert chunks[-1].finish_reason == "stop"
    assert engine.pool.num_in_use == 0


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral): its Metaspace decoder strips the
    leading space of a text's first token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_the_first_output_token_keeps_its_space_after_the_prompt():
    """Started after the prompt, as vLLM's stream is, a Metaspace decoder keeps " Paris"
    whole; started alone it would strip its space, and a client that joins prompt and
    completion would read "The capital isParis."."""
    tokenizer = metaspace_tokenizer()
    prompt, output = [1, 2, 3], [4, 5]
    assert tokenizer.decode(output) == "Paris."  # the first token of a text loses its space
    detok = IncrementalDetokenizer(tokenizer, [], prompt_ids=prompt)
    assert [detok.add(t) for t in output] == [" Paris", "."]
    assert tokenizer.decode(prompt) + " Paris." == tokenizer.decode(prompt + output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_in_the_text_only_when_not_skipped(smollm_tokenizer, ids, skip):
    special = smollm_tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokens = [ids[0], special, ids[1], special]
    detok = IncrementalDetokenizer(smollm_tokenizer, [], skip_special_tokens=skip,
                                   prompt_ids=[special, ids[2]])
    text = "".join(detok.add(t) for t in tokens) + detok.flush()
    assert text == smollm_tokenizer.decode(tokens, skip_special_tokens=skip)
    assert text == ("Hello world" if skip else "Hello<|im_start|> world<|im_start|>")


def test_a_prompt_ending_mid_character_gives_none_of_its_bytes_to_the_output(smollm_tokenizer):
    """The last prompt tokens hold the first bytes of a four-byte character: the stream starts
    afresh rather than emit the prompt's pending bytes as the output's first text."""
    clef = smollm_tokenizer.encode("𝄞", add_special_tokens=False)
    assert len(clef) == 3 and smollm_tokenizer.decode(clef[:2]) == "\ufffd"
    hello = smollm_tokenizer.encode("Hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer, [], prompt_ids=hello + clef[:2])
    assert "".join(detok.add(t) for t in hello) + detok.flush() == "Hello"
