"""Constrained decoding on llguidance: a request's :class:`StructuredOutput` compiled once per
constraint, and a matcher per sequence that masks the tokens the constraint forbids.

llguidance was chosen by measurement against xgrammar and outlines-core
(``benchmarks/grammar_engines.py``; docs/design-decisions.md, "Structured output"). Its compile
is lazy: the grammar text is checked up front and the token-level work happens as masks are
asked for, so a new schema never stalls a step.

The matcher advances only over committed tokens: a draft is cut at its first token the
constraint rejects, and verification reads each position's mask by stepping over the drafts
and rolling back (``masks_along``). With EOS allowed only where the constraint may end, a
sequence that stops on EOS (or because the constraint admits nothing more) holds a complete
match; one cut at ``max_tokens`` holds a prefix of one, which near the end of the budget is
steered to close (``closing.py``) so that it parses, too.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf

from contract.request import InvalidRequestError, StructuredOutput
from contract.schema_limits import grammar_fault, schema_fault
from workers.structured.closing import (
    CLOSING_WINDOW,
    LOOP_SPAN,
    ClosingEstimate,
    ClosingState,
    ClosingTokens,
    mask_key,
)
from workers.structured.masks import MaskBuffer, PositionMask

MAX_CACHED_GRAMMARS = 256
"""Compiled constraints kept per engine, least recently used dropped first."""


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` constraints for one tokenizer, cached.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logit rows), in tokens; at least the tokenizer's.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        # Keyed by (kind, spec): the same constraint from another field compiles once.
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.closing_tokens = ClosingTokens(self._tokenizer, vocab_size)
        self._lock = threading.Lock()  # requests are validated off the engine thread

    def compile(self, structured: StructuredOutput) -> str:
        """The llguidance grammar of ``structured``, checked (cached per constraint).

        Raises:
            InvalidRequestError: the constraint is malformed or uses what llguidance does not
                support; the message is llguidance's, naming the place.
        """
        key = (structured.kind, structured.spec)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        param = structured.param or _PARAMS[structured.kind]
        grammar = _grammar_text(structured, param)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidRequestError(_error_message(structured.kind, param, error), param)
        self._check_admits_output(grammar, structured.kind, param)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def _check_admits_output(self, grammar: str, kind: str, param: str) -> None:
        """Refuses a constraint that no output can even start: a grammar whose first lexeme
        is empty (``A: /a/ & /b/``), which llguidance's check passes and its first mask turns
        into an error (a JSON schema that cannot be satisfied, ``minLength`` over
        ``maxLength`` or an ``allOf`` of two types, its check already refuses). Costs one
        mask, once per cached constraint. A dead end further in is not found here.

        Raises:
            InvalidRequestError: naming ``param``.
        """
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        mask = MaskBuffer(self.vocab_size).fill(matcher)  # computing it finds the dead end
        if matcher.is_error() or not bool(mask.any()):
            reason = "no token can start it"
            raise InvalidRequestError(f"the {kind} constraint admits no output: {reason}",
                                      param)

    def matcher(self, structured: StructuredOutput, min_tokens: int = 0) -> GrammarMatcher:
        """A fresh matcher for one sequence that may end after ``min_tokens`` output tokens
        (raises as :meth:`compile`)."""
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, self.compile(structured)),
                              self.closing_tokens, min_tokens,
                              structured.param or _PARAMS[structured.kind])


class GrammarMatcher:
    """Where one sequence stands in its constraint.

    Args:
        matcher: llguidance's matcher, at the start of the output.
        closing_tokens: what closing near the end of the budget prefers.
        min_tokens: output tokens before EOS is allowed (the request's ``min_tokens``), so
            closing does not narrow a mask to EOS alone where the sampler forbids it.
        param: the request field the constraint came from, named by a dead end's error.

    Attributes:
        steered: closing chose a committed token where the model would have chosen another,
            so the output was ended short of where the model would have taken it.
    """

    def __init__(self, matcher: llguidance.LLMatcher, closing_tokens: ClosingTokens,
                 min_tokens: int = 0, param: str = "structured_outputs"):
        self._matcher = matcher
        self._param = param
        self._min_tokens = min_tokens
        self._closing_tokens = closing_tokens
        self._estimate = ClosingEstimate(matcher, closing_tokens)
        self._mask = MaskBuffer(closing_tokens.vocab_size)
        self._position = 0  # output tokens consumed
        # Per position: closing's decision, and within closing's window the key of the
        # position's mask (to find loops).
        self._closing: list[tuple[ClosingState, int | None]] = []
        self.steered = False

    def allowed(self, budget: int, after_drafts: bool = False) -> PositionMask:
        """What the constraint admits next, with ``budget`` tokens left to produce: its
        tokens (EOS only where it may end) and, from where closing must start, the part of
        them closing admits (``closing.py``). ``allowed`` is the matcher's own buffer,
        rewritten by the next call.

        Raises:
            InvalidRequestError: naming the constraint's field, where it has reached a dead
                end: the output so far admits no next token, nor an end (a grammar that
                cannot be completed, which the check at compile time finds only at the
                start). Not ``after_drafts`` (a position a draft leads to: the target may
                not take it there).
        """
        position = self._position
        del self._closing[position:]  # entries past here were a verification's drafts'
        previous = self._closing[-1][0] if self._closing else ClosingState.start(budget)
        history = [key for _, key in self._closing[1 - LOOP_SPAN:] if key is not None]
        state = self._estimate.decide(previous, budget, history)
        mask = self._mask.fill(self._matcher)
        if self._matcher.is_error() and not after_drafts:
            reason = self._reason()
            raise self._too_complex(reason) or InvalidRequestError(
                f"{self._param}: the constraint reached a dead end after {position} output "
                f"tokens: no token may follow, and the output may not end there ({reason})",
                self._param)
        self._closing.append((state, mask_key(mask.numpy()) if budget <= CLOSING_WINDOW else None))
        if not state.closing:
            return PositionMask(mask, self._estimate.hold_openers(mask, state, budget, history))
        return PositionMask(mask, self._estimate.steer(mask, budget,
                                                       position >= self._min_tokens, history))

    def consume(self, token_id: int, steered: bool = False) -> None:
        """Advance over a committed token (:meth:`end` says what ``steered`` is).

        Raises:
            InvalidRequestError: naming the constraint's field, where taking the token goes past
                one of llguidance's limits (the token was allowed; following it is too costly).
            RuntimeError: the constraint rejects it otherwise (the sampler masked it: a
                defect).
        """
        if not self._matcher.consume_token(token_id):
            reason = self._reason()
            raise self._too_complex(reason) or RuntimeError(
                f"the constraint rejected token {token_id}: {self._matcher.get_error()}")
        self.end(steered)
        self._position += 1

    def _reason(self) -> str:
        """The first line of llguidance's error (the rest is its state and grammar)."""
        return (self._matcher.get_error().splitlines() or ["no reason given"])[0]

    def _too_complex(self, reason: str) -> InvalidRequestError | None:
        """The client's error where ``reason`` is one of llguidance's limits on the work a
        token may take (``ParserTooComplex``: an ``anyOf`` of many large objects), not a fault
        of the output; else None."""
        if not _ENGINE_LIMIT.search(reason):
            return None
        return InvalidRequestError(
            f"{self._param}: the constraint is too complex to follow after {self._position} "
            f"output tokens ({reason}); simplify it, e.g. fewer anyOf branches", self._param)

    def end(self, steered: bool = False) -> None:
        """A token was committed here (EOS, which ends the sequence and is never consumed,
        or one :meth:`consume` takes): :attr:`steered` from now on if closing chose it (the
        sampler's first draw fell outside the position's ``narrowed`` mask)."""
        self.steered |= steered

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the constraint admits from here (nothing consumed):
        where a draft is cut before verification."""
        return self._matcher.validate_tokens(tokens)

    def masks_along(self, tokens: list[int], budget: int) -> list[PositionMask]:
        """The masks at each of the ``len(tokens) + 1`` positions of a verification block:
        here, then after each of ``tokens`` (which the constraint must admit, see
        :meth:`valid_prefix`), with ``budget`` tokens left to produce here; each its own
        copy. The drafts are taken on a copy of the matcher: one that leads to a dead end
        leaves a matcher in error, which ``rollback`` cannot undo.

        Raises:
            InvalidRequestError: as :meth:`allowed`, for this position only.
        """
        here = self.allowed(budget)
        masks = [here._replace(allowed=here.allowed.clone())]
        real = self._matcher
        self._matcher = self._estimate.matcher = real.deep_copy()
        try:
            for i, token in enumerate(tokens, start=1):
                self.consume(token)
                after = self.allowed(budget - i, after_drafts=True)
                masks.append(after._replace(allowed=after.allowed.clone()))
        finally:
            self._matcher = self._estimate.matcher = real
            self._position -= len(tokens)
        return masks

    @property
    def is_stopped(self) -> bool:
        """The constraint admits nothing more: the output is complete."""
        return self._matcher.is_stopped()


def _error_message(kind: str, param: str, error: str) -> str:
    """What a 400 says of llguidance's ``error`` for a constraint of ``kind`` from ``param``.
    For ``tools`` the grammar is the server's, built around the tools' parameter schemas:
    only the schema's fault is kept, not the listing of a grammar the client never wrote."""
    if param == "tools":
        fault = re.sub(r"^at \d+\(\d+\): ", "", error.splitlines()[0])
        return f"invalid tool parameters: {fault}"
    return f"invalid {kind} constraint: {error}"


_ENGINE_LIMIT = re.compile(r"max is \d+|too complex", re.IGNORECASE)
"""How llguidance's errors name its limits (``Current row has 6520 items; max is 2000``)."""

_PARAMS = {"json": "response_format", "regex": "structured_outputs",
           "choice": "structured_outputs", "grammar": "structured_outputs"}


def _grammar_text(structured: StructuredOutput, param: str) -> str:
    """llguidance's grammar for one constraint (unchecked).

    Raises:
        InvalidRequestError: naming ``param``, for a constraint llguidance cannot read: one
            holding an unpaired UTF-16 surrogate (valid in JSON, but no UTF-8 text can carry
            it), which llguidance's converters fail on instead of reporting; or a JSON Schema
            whose bounds it crashes on or gets wrong (:mod:`contract.schema_limits`).
    """
    fault = _schema_fault(structured)
    if fault:
        raise InvalidRequestError(_error_message(structured.kind, param, fault), param)
    try:
        return _converted(structured)
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"invalid {structured.kind} constraint: it holds an unpaired UTF-16 surrogate "
            f"({exc.object[exc.start:exc.end]!a}), which no UTF-8 text can carry",
            param) from exc


def _schema_fault(structured: StructuredOutput) -> str | None:
    """:mod:`contract.schema_limits`'s objection to the JSON Schemas of ``structured``."""
    if structured.kind == "grammar":
        return grammar_fault(structured.spec)
    if structured.kind != "json":
        return None
    try:
        schema = json.loads(structured.spec)
    except (ValueError, RecursionError):
        return None  # llguidance names the fault
    return schema_fault(schema)


def _converted(structured: StructuredOutput) -> str:
    """:func:`_grammar_text`'s conversion, by the constraint's kind."""
    if structured.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(structured.spec)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "choice":
        choices = json.loads(structured.spec)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in choices))
    return llguidance.LLMatcher.grammar_from_lark(structured.spec)
