"""The paper check: measured speculative speedup against Leviathan et al. (2023)'s formula.

"Fast Inference from Transformers via Speculative Decoding" (Leviathan, Kalman, Matias, 2023)
predicts the walltime speedup of speculative decoding with ``gamma`` draft tokens per step, a
per-token acceptance rate ``alpha`` and a draft cost ``c`` (one drafted token's time as a
fraction of one target step) as

    S = (1 - alpha^(gamma + 1)) / ((1 - alpha) (gamma c + 1))

The numerator is the expected tokens one verification step commits; the denominator the step's
cost in target steps, assuming verifying ``gamma`` drafts costs one target step. On a CPU the
``gamma`` extra query rows of a verification step cost something, so this script also measures

    c_verify = (verify step time with gamma drafts - plain step time) / (gamma plain step time)

and predicts with ``c_total = c_draft + c_verify`` as well: once with each configuration's own
c_verify (from the same runs, so this checks the expected tokens per step given the measured
costs) and once with c_verify per gamma pooled over every c = 0 run at that gamma (a cost model
not taken from the configuration it predicts).

Method: :class:`ControlledProposer`, a test-only proposer defined here, knows each prompt's
plain greedy continuation (one run without speculation) and proposes it, replacing each draft
token independently with probability ``1 - alpha`` by another token, so a draft position is
accepted (given all before it were) with probability ``alpha``. It may sleep ``c`` plain step
times per drafted token to emulate a draft model's cost. Our engine runs each prompt alone
(batch 1), greedy, EOS ignored, with the adaptive controller off (k = gamma every step). For
each (alpha, gamma, c) it reports the speedup in decode tokens/s over no speculation (plain
runs interleaved with the speculative ones; T is their median), the measured alpha (accepted /
reached draft positions: the conditional per-position acceptance, pooled), the measured c_draft
and c_verify, both predictions, and whether each is within 20% of the measurement. Writes JSON and
a PNG (measured against predicted; matplotlib, skipped with a note when it is missing).

    .venv/bin/python benchmarks/spec_paper_check.py [--alphas 0.3,0.6,0.8,0.95]
        [--gammas 1,2,4,6] [--costs 0,0.2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path, the repo root is not
    import common

TOLERANCE = 0.2
"""A prediction matches when measured / predicted is within 1 +- this."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, "spec_paper_check")
    parser.add_argument("--alphas", default="0.3,0.6,0.8,0.95",
                        help="acceptance rates the proposer is set to")
    parser.add_argument("--gammas", default="1,2,4,6", help="draft lengths (k every step)")
    parser.add_argument("--costs", default="0,0.2",
                        help="emulated draft cost c per drafted token, in plain step times; "
                             "c > 0 runs only at the largest alpha and gammas >= 2")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the draft corruption")
    parser.add_argument("--png", default=None,
                        help="where to write the plot (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.quick:
        args.alphas, args.gammas, args.costs = "0.5,0.9", "1,3", "0,0.5"
        args.prompts, args.prompt_tokens, args.output_tokens, args.repeats = 1, 16, 24, 1
        args.kv_cache_mib = 16
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.gammas = [int(g) for g in args.gammas.split(",")]
    args.costs = [float(c) for c in args.costs.split(",")]
    args.png = args.png or str(Path(args.out).with_suffix(".png"))
    return args


class ControlledProposer:
    """A test-only proposer with a chosen acceptance rate and draft cost.

    It proposes the next ``k`` tokens of the request's known greedy continuation, each replaced
    independently with probability ``1 - alpha`` by a different token, so (greedy, fp32, the
    target's output equal to that continuation) a draft position is accepted with probability
    ``alpha`` given all before it were. Each call then sleeps ``cost_s`` per drafted token.

    Attributes:
        truth: request id → its plain greedy output tokens (set before each run).
        alpha: probability a draft token is kept uncorrupted.
        cost_s: seconds slept per drafted token.
        calls: ``(drafted tokens, seconds)`` of every call.
    """

    name = "controlled"

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.truth: dict[str, list[int]] = {}
        self.alpha = 1.0
        self.cost_s = 0.0
        self.calls: list[tuple[int, float]] = []
        self._rng = random.Random(seed)

    def reset(self, alpha: float, cost_s: float, seed: int) -> None:
        self.alpha, self.cost_s = alpha, cost_s
        self.calls = []
        self._rng = random.Random(seed)

    def propose(self, requests) -> list[list[int]]:
        begin = time.perf_counter()
        drafts = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens
            draft = self.truth[r.request_id][done:done + r.k]
            drafts.append([t if self._rng.random() < self.alpha else self._corrupt(t)
                           for t in draft])
        drafted = sum(map(len, drafts))
        if self.cost_s and drafted:
            time.sleep(self.cost_s * drafted)
        self.calls.append((drafted, time.perf_counter() - begin))
        return drafts

    def _corrupt(self, token: int) -> int:
        return (token + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def finish(self, request_ids: list[str]) -> None:
        """Nothing to drop (``truth`` is the script's)."""


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. (2023), eq. in section 3.4: S = (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    expected = gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected / (gamma * c + 1)


def build_engine(loaded, gamma: int | None, proposer, args):
    """Our engine over ``loaded``: no speculation (``gamma`` None) or k = ``gamma`` always."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.speculative.config import SpeculativeConfig
    # ``method`` only switches speculation on: the engine uses the proposer it is given.
    spec = (SpeculativeConfig() if gamma is None else SpeculativeConfig(
        method="ngram", num_speculative_tokens=gamma, adaptive=False))
    dtype = str(loaded.dtype).removeprefix("torch.")
    return LLMEngine(EngineConfig(dtype=dtype, device="cpu",
                                  kv_cache_bytes=args.kv_cache_mib << 20,
                                  num_threads=args.threads, speculative=spec),
                     loaded=loaded, proposer=proposer if gamma is not None else None)


def run_prompts(engine, prompts: list[list[int]], max_tokens: int, tag: str,
                proposer: ControlledProposer | None = None,
                truth: list[list[int]] | None = None) -> dict:
    """Each prompt alone, to exactly ``max_tokens`` tokens. Returns summed decode tokens
    (after the first), decode seconds, decode steps, the outputs, and the speculative counts
    (proposed / accepted per position)."""
    decode_tokens = decode_steps = 0
    decode_s = 0.0
    outputs, usages = [], []
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        if proposer is not None:
            proposer.truth = {rid: truth[i]}
        engine.reset_prefix_cache()
        engine.add_request(common.greedy_request(rid, prompt, max_tokens))
        times: list[float] = []
        tokens: list[int] = []
        usage = None
        while engine.has_work():
            chunks = engine.step()
            stamp = time.perf_counter()
            for chunk in chunks:
                times += [stamp] * len(chunk.token_ids)
                tokens += chunk.token_ids
                usage = chunk.spec or usage
        decode_tokens += len(times) - 1
        decode_s += times[-1] - times[0]
        decode_steps += len(set(times)) - 1
        outputs.append(tokens)
        usages.append(usage)
    return {"decode_tokens": decode_tokens, "decode_s": decode_s, "decode_steps": decode_steps,
            "token_ids": outputs, "usages": [u for u in usages if u is not None]}


def conditional_acceptance(usages) -> tuple[int, int]:
    """(accepted, reached) draft positions: position i is reached when every draft before it
    was accepted (the engine counts position i as accepted when i < accepted drafts)."""
    accepted = reached = 0
    for u in usages:
        for i, (a, p) in enumerate(zip(u.accepted_by_position, u.proposed_by_position,
                                       strict=True)):
            accepted += a
            reached += p if i == 0 else u.accepted_by_position[i - 1]
    return accepted, reached


def configurations(args) -> list[tuple[float, int, float]]:
    """(alpha, gamma, c): every alpha x gamma at c = 0; other costs at the largest alpha and
    gammas >= 2 (where a draft cost decides whether speculation still pays)."""
    configs = [(a, g, 0.0) for a in args.alphas for g in args.gammas]
    for c in args.costs:
        if c > 0:
            configs += [(max(args.alphas), g, c) for g in args.gammas if g >= 2]
    return configs


def measure(loaded, prompts, args) -> tuple[list[dict], dict]:
    """Run every configuration ``args.repeats`` times, with a plain run before each alpha
    group (and each cost group); returns per-configuration rows and the plain figures.

    The plain step time T every speedup and cost ratio is taken against is the median over all
    plain runs (one slow plain run on a shared machine would otherwise skew a whole group);
    the per-run figures are kept to show drift.
    """
    plain_engine = build_engine(loaded, None, None, args)
    proposer = ControlledProposer(loaded.model.config.vocab_size, args.seed)
    engines = {g: build_engine(loaded, g, proposer, args) for g in args.gammas}
    run_prompts(plain_engine, prompts[:1], 4, "warmup")
    reference = run_prompts(plain_engine, prompts, args.output_tokens, "reference")
    truth = reference["token_ids"]
    for g, engine in engines.items():
        proposer.reset(1.0, 0.0, 0)
        run_prompts(engine, prompts[:1], min(4 + g, args.output_tokens), f"warmup-{g}",
                    proposer, truth)
    configs = configurations(args)
    raw: dict[tuple, list[dict]] = {cfg: [] for cfg in configs}
    plain_steps: list[float] = []
    identical = True
    for repeat in range(args.repeats):
        for n, (alpha, gamma, cost) in enumerate(configs):
            if n == 0 or (alpha, cost) != configs[n - 1][::2]:
                plain = run_prompts(plain_engine, prompts, args.output_tokens,
                                    f"plain-{repeat}-{n}")
                plain_steps.append(plain["decode_s"] / plain["decode_steps"])
                identical &= plain["token_ids"] == truth
            plain_step_s = statistics.median(plain_steps)
            proposer.reset(alpha, cost * plain_step_s,
                           hash((args.seed, repeat, alpha, gamma, cost)) & 0xFFFFFFFF)
            spec = run_prompts(engines[gamma], prompts, args.output_tokens,
                               f"spec-{repeat}-{n}", proposer, truth)
            identical &= spec["token_ids"] == truth
            accepted, reached = conditional_acceptance(spec["usages"])
            sample = {"tokens": spec["decode_tokens"], "seconds": spec["decode_s"],
                      "steps": spec["decode_steps"], "accepted": accepted, "reached": reached,
                      "draft_s": sum(s for _, s in proposer.calls),
                      "drafted": sum(d for d, _ in proposer.calls),
                      "draft_calls": len(proposer.calls)}
            raw[(alpha, gamma, cost)].append(sample)
            figures = derive(sample, gamma, plain_step_s)
            common.log(f"repeat {repeat + 1}/{args.repeats} alpha {alpha} gamma {gamma} c {cost}:"
                       f" speedup {figures['speedup']:.2f}, alpha measured "
                       f"{accepted / max(1, reached):.2f}, c_draft {figures['c_draft']:.2f}, "
                       f"c_verify {figures['c_verify']:.2f}")
    plain_step_s = statistics.median(plain_steps)
    derived = {cfg: [derive(s, cfg[1], plain_step_s) | s for s in raw[cfg]] for cfg in configs}
    # c_verify per gamma from every c = 0 run at that gamma (all alphas): a cost model that
    # does not come from the configuration it predicts.
    pooled = {g: statistics.median(s["c_verify"] for cfg in configs if cfg[1] == g
                                   and cfg[2] == 0 for s in derived[cfg])
              for g in args.gammas}
    rows = [summarise(cfg, derived[cfg], pooled[cfg[1]]) for cfg in configs]
    plain_info = {"step_ms_median": plain_step_s * 1000, "c_verify_by_gamma": pooled,
                  "step_ms_all": [s * 1000 for s in plain_steps],
                  "outputs_identical_to_reference": identical}
    return rows, plain_info


def derive(sample: dict, gamma: int, plain_step_s: float) -> dict:
    """Speedup, step times and cost ratios of one speculative run against plain step time T
    (a plain decode step commits one token, so plain decode tokens/s = 1 / T)."""
    step_s = sample["seconds"] / sample["steps"]
    draft_per_step = sample["draft_s"] / max(1, sample["draft_calls"])
    verify_step_s = step_s - draft_per_step
    return {"speedup": sample["tokens"] / sample["seconds"] * plain_step_s,
            "plain_step_s": plain_step_s, "spec_step_s": step_s, "verify_step_s": verify_step_s,
            "c_draft": sample["draft_s"] / max(1, sample["drafted"]) / plain_step_s,
            "c_verify": (verify_step_s - plain_step_s) / (gamma * plain_step_s),
            "tokens_per_step": sample["tokens"] / sample["steps"]}


def summarise(config: tuple[float, int, float], samples: list[dict],
              c_verify_pooled: float) -> dict:
    """One configuration: medians of the timed figures over repeats, alpha pooled, the
    predictions (c = c_draft; c = c_draft + this configuration's c_verify; c = c_draft + the
    c_verify of every c = 0 run at this gamma) and their ratios to the measurement."""
    alpha_set, gamma, cost = config
    accepted = sum(s["accepted"] for s in samples)
    reached = sum(s["reached"] for s in samples)
    alpha = accepted / reached if reached else 0.0

    def med(key):
        return statistics.median(s[key] for s in samples)

    measured = med("speedup")
    c_draft, c_verify = med("c_draft"), med("c_verify")
    paper = predicted_speedup(alpha, gamma, c_draft)
    total = predicted_speedup(alpha, gamma, c_draft + c_verify)
    pooled = predicted_speedup(alpha, gamma, c_draft + c_verify_pooled)
    return {"alpha_set": alpha_set, "gamma": gamma, "c_set": cost,
            "alpha_measured": alpha, "accepted_positions": accepted,
            "reached_positions": reached, "c_draft": c_draft, "c_verify": c_verify,
            "plain_step_ms": med("plain_step_s") * 1000,
            "verify_step_ms": med("verify_step_s") * 1000,
            "tokens_per_step_measured": med("tokens_per_step"),
            "tokens_per_step_predicted": predicted_speedup(alpha, gamma, 0.0),
            "speedup_measured": measured, "speedup_repeats": [s["speedup"] for s in samples],
            "c_verify_pooled_by_gamma": c_verify_pooled,
            "predicted_paper_c_draft": paper, "predicted_c_total": total,
            "predicted_c_total_pooled": pooled,
            "ratio_to_paper": measured / paper, "ratio_to_c_total": measured / total,
            "ratio_to_c_total_pooled": measured / pooled,
            "paper_within_20pct": abs(measured / paper - 1) <= TOLERANCE,
            "c_total_within_20pct": abs(measured / total - 1) <= TOLERANCE,
            "c_total_pooled_within_20pct": abs(measured / pooled - 1) <= TOLERANCE}


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Measured against predicted speedup (both predictions), y = x and the +-20% band; and
    speedup against gamma per alpha. Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    top = max(max(r["predicted_paper_c_draft"], r["predicted_c_total"],
                  r["predicted_c_total_pooled"], r["speedup_measured"]) for r in rows) * 1.1
    line = [0, top]
    left.plot(line, line, color="black", lw=0.8, label="measured = predicted")
    left.fill_between(line, [v * (1 - TOLERANCE) for v in line],
                      [v * (1 + TOLERANCE) for v in line], color="grey", alpha=0.15,
                      label="+-20%")
    left.scatter([r["predicted_paper_c_draft"] for r in rows],
                 [r["speedup_measured"] for r in rows], marker="o", facecolors="none",
                 edgecolors="tab:red", label="paper: verify = 1 target step (c = c_draft)")
    left.scatter([r["predicted_c_total"] for r in rows], [r["speedup_measured"] for r in rows],
                 marker="x", color="tab:blue", label="c = c_draft + c_verify (same runs)")
    left.scatter([r["predicted_c_total_pooled"] for r in rows],
                 [r["speedup_measured"] for r in rows], marker="+", color="tab:green",
                 label="c = c_draft + c_verify(gamma), pooled over alphas")
    left.set(xlabel="predicted speedup S", ylabel="measured speedup (decode tokens/s)",
             xlim=(0, top), ylim=(0, top), title="measured vs predicted")
    left.legend(fontsize=8)
    for i, alpha in enumerate(sorted({r["alpha_set"] for r in rows if r["c_set"] == 0})):
        sub = sorted((r for r in rows if r["alpha_set"] == alpha and r["c_set"] == 0),
                     key=lambda r: r["gamma"])
        color = f"C{i}"
        gammas = [r["gamma"] for r in sub]
        right.plot(gammas, [r["speedup_measured"] for r in sub], "o-", color=color,
                   label=f"alpha {alpha}: measured")
        right.plot(gammas, [r["predicted_c_total"] for r in sub], "x--", color=color,
                   label=f"alpha {alpha}: predicted (c_total)")
        right.plot(gammas, [r["predicted_paper_c_draft"] for r in sub], ":", color=color)
    right.axhline(1.0, color="black", lw=0.8)
    right.set(xlabel="gamma (draft tokens per step)", ylabel="speedup",
              title="c = 0 (dotted: paper formula)")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    common.log(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    load_before = os.getloadavg()
    loaded = common.load(args.model, args.dtype)
    prompts = common.text_prompts(loaded.tokenizer, args.prompts, args.prompt_tokens)
    common.log(f"{len(prompts)} prompts x {args.prompt_tokens} tokens, {args.output_tokens} "
               f"output tokens; alphas {args.alphas}, gammas {args.gammas}, costs {args.costs}; "
               f"{threads} threads, {loaded.dtype}")
    common.set_threads(args.threads)
    rows, plain = measure(loaded, prompts, args)
    matched = {key: sum(r[key] for r in rows) for key in (
        "paper_within_20pct", "c_total_within_20pct", "c_total_pooled_within_20pct")}
    goals = [common.goal("configurations where the paper formula (c = c_draft) is within 20%",
                         matched["paper_within_20pct"] / len(rows), 1.0),
             common.goal("configurations where S with c = c_draft + c_verify is within 20%",
                         matched["c_total_within_20pct"] / len(rows), 1.0),
             common.goal("configurations where S with c = c_draft + c_verify(gamma) pooled over "
                         "alphas is within 20%",
                         matched["c_total_pooled_within_20pct"] / len(rows), 1.0)]
    title = (f"Leviathan et al. 2023 speedup check: {args.model} {loaded.dtype}, batch 1, "
             f"{threads} threads, {common.cpu_info()['model']}")
    png = plot(rows, args.png, title)
    result = {"benchmark": "spec_paper_check", "machine": common.machine_info(loaded.dtype),
              "threads": threads, "model": args.model, "quick": args.quick,
              "load_average": {"start": load_before, "end": os.getloadavg()},
              "workload": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "greedy": True,
                           "ignore_eos": True, "repeats": args.repeats, "adaptive": False,
                           "alphas": args.alphas, "gammas": args.gammas, "costs": args.costs,
                           "formula": "S = (1 - a^(g+1)) / ((1 - a)(g c + 1))",
                           "c_verify": "(verify step time with g drafts - plain step time) / "
                                       "(g * plain step time)",
                           "note": "c_verify comes from the same runs as the speedup it "
                                   "predicts, so predicted_c_total checks the expected tokens "
                                   "per step (the alpha part of S) given the measured step "
                                   "costs; predicted_c_total_pooled uses c_verify per gamma "
                                   "from every c = 0 run (all alphas) instead"},
              "plain": plain, "rows": rows, "png": png, "goals": goals}
    common.log_goals(goals)
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
