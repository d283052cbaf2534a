"""Train the demo pair: a small qwen3 target on the Python standard library's own source files, then its
DSpark draft with `mlx_dspark.train`, and measure the pair's acceptance on held-out files.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/train_demo_pair.py --out mlx_dspark/demo

(on Linux CPUs, OpenBLAS makes MLX's float32 matmuls ~15x faster; on a Mac run it as is.)

Corpus: the `.py` files under `sysconfig.get_paths()["stdlib"]` (no tests, no site-packages), sorted;
every 20th file is held out. Steps, each seeded:
1. a byte-level BPE tokenizer (`tokenizers`, 2048 entries, Qwen-style special tokens and `<|mask|>`);
2. the target: Qwen3ForCausalLM, 6 layers, hidden 128, 2 x 64 query heads, 1 KV head, tied embeddings,
   trained with next-token cross-entropy on random windows of the training files;
3. the draft: 3 sliding-window layers (window 128), taps spread over the target, block 7, vanilla
   Markov head, confidence head, trained with `mlx_dspark.train` on a quarter of the training files plus
   the target's own continuations of training-file prefixes (DeepSpec trains on the target's generations), then
   calibrated (greedy acceptance) on held-out files;
4. greedy and T=1 mean acceptance lengths with `mlx_dspark.generate` on prefixes of held-out files.
Both checkpoints are written in the Hugging Face / DeepSpec layouts in float16.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__", "ensurepip", "tkinter"}
HELD_OUT_EVERY = 20
VOCAB_SIZE = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "model_type": "qwen3",
    "num_attention_heads": 2,
    "num_hidden_layers": 6,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB_SIZE,
}


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the stdlib's .py files outside tests and vendored trees, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & SKIPPED_DIRS and p.stat().st_size > 0
    )
    held_out = files[::HELD_OUT_EVERY]
    train = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY]
    return train, held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# -- tokenizer ---------------------------------------------------------------------------------------


def train_tokenizer(files: list[Path], directory: Path):
    """A byte-level BPE trained on the training files; writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tokenizer.train_from_iterator((read(p) for p in files), trainer=trainer, length=len(files))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {s: tokenizer.token_to_id(s) for s in SPECIALS}
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for s, i in ids.items()
    }
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tokenizer, ids


def token_stream(tokenizer, files: list[Path], eos: int) -> np.ndarray:
    """All training files as one token stream, each file followed by <|endoftext|>."""
    encoded = tokenizer.encode_batch([read(p) for p in files])
    return np.concatenate([np.array(e.ids + [eos], dtype=np.int32) for e in encoded])


# -- target ------------------------------------------------------------------------------------------


def train_target(stream: np.ndarray, *, steps: int, batch: int, seq_len: int, lr: float, seed: int):
    from mlx_dspark.models.layers import qwen3

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(TARGET_CONFIG))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.02  # tied head: small logits at start
    warmup = max(steps // 20, 1)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr * 0.05)], [warmup]
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    state = [model.state, optimizer.state]

    def loss_fn(model, inputs, labels):
        logits, _ = model(inputs)
        return nn.losses.cross_entropy(logits, labels, reduction="mean")

    @partial(mx.compile, inputs=state, outputs=state)
    def step(inputs, labels):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, inputs, labels)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    start, smoothed = time.perf_counter(), None
    for i in range(steps):
        offsets = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        window = np.stack([stream[o : o + seq_len + 1] for o in offsets])
        loss = step(mx.array(window[:, :-1]), mx.array(window[:, 1:]))
        mx.eval(state)
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if (i + 1) % 50 == 0 or i + 1 == steps:
            log(f"target step {i + 1}/{steps}: loss {smoothed:.3f} ({time.perf_counter() - start:.0f} s)")
    return model, smoothed, time.perf_counter() - start


def save_target(model, tokenizer_dir: Path, directory: Path, eos: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    config = dict(TARGET_CONFIG, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, torch_dtype="float16")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # it learned raw Python, never ChatML: generate sends prompts as raw text (cli/demo.raw_text_prompts)
    generation = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "mlx_dspark_prompt_format": "raw"}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


# -- the target's own continuations, for the draft -----------------------------------------------------


def continuations(model, tokenizer, files: list[Path], *, count: int, prompt_len: int, new_tokens: int, seed: int) -> list[dict]:
    """prompt/completion records: the target's continuations (half greedy, half T=1) of training-file prefixes."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)  # the T=1 draws
    encoded = [e.ids for e in tokenizer.encode_batch([read(p) for p in files])]
    candidates = [ids for ids in encoded if len(ids) > prompt_len + 1]
    records = []
    batch = 32
    for start in range(0, count, batch):
        prompts = []
        for _ in range(min(batch, count - start)):
            ids = candidates[rng.integers(len(candidates))]
            offset = rng.integers(0, len(ids) - prompt_len)
            prompts.append(ids[offset : offset + prompt_len])
        tokens = mx.array(np.array(prompts, dtype=np.int32))
        cache = model.make_cache()
        logits, _ = model(tokens, cache)
        greedy = start // batch % 2 == 0
        out = []
        for _ in range(new_tokens):
            last = logits[:, -1].astype(mx.float32)
            nxt = mx.argmax(last, axis=-1) if greedy else mx.random.categorical(last)
            out.append(nxt)
            logits, _ = model(nxt[:, None].astype(mx.int32), cache)
        generated = np.array(mx.stack(out, axis=1))
        for prompt, completion in zip(prompts, generated.tolist()):
            records.append({"prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(completion)})
    return records


# -- measurement -------------------------------------------------------------------------------------


def measure(target_dir: Path, draft_dir: Path, files: list[Path], *, prompt_tokens: int, max_tokens: int) -> dict:
    """Mean acceptance length (accepted drafts + 1 per verify round) over prefixes of held-out files."""
    import mlx_dspark

    pair = mlx_dspark.load(str(target_dir), draft=str(draft_dir), dtype="float32")
    results = {}
    for name, options in {
        "greedy": dict(temperature=0.0),
        "T=1, sampled drafts": dict(temperature=1.0, draft_sampling="sample", seed=0),
        "T=1, greedy drafts": dict(temperature=1.0, draft_sampling="greedy", seed=0),
    }.items():
        lengths, tokens, seconds = [], 0, 0.0
        for path in files:
            ids = pair.tokenizer.encode(read(path), add_special_tokens=False)[:prompt_tokens]
            result = mlx_dspark.generate(pair, ids, max_tokens=max_tokens, **options)
            lengths.extend(result.acceptance_lengths)
            tokens += len(result.tokens)
            seconds += result.total_time
        results[name] = {"mean_acceptance_length": round(sum(lengths) / max(len(lengths), 1), 3), "rounds": len(lengths), "tokens": tokens}
        log(f"{name}: mean acceptance length {results[name]['mean_acceptance_length']:.2f} over {len(lengths)} rounds ({len(files)} files)")
    sample = mlx_dspark.generate(pair, pair.tokenizer.encode(read(files[0]), add_special_tokens=False)[:prompt_tokens], max_tokens=64)
    results["sample_output"] = sample.text
    return results


def directory_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/target and OUT/draft")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mlx_dspark_demo_work"), help="intermediate files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=800)
    parser.add_argument("--target-batch", type=int, default=8)
    parser.add_argument("--target-seq-len", type=int, default=256)
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--continuations", type=int, default=1024, help="target continuations added to the draft's data")
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--draft-window", type=int, default=128)
    parser.add_argument("--measure-files", type=int, default=16)
    parser.add_argument("--skip-target", action="store_true", help="reuse OUT/target (train the draft only)")
    parser.add_argument("--measure-only", action="store_true")
    args = parser.parse_args()

    from mlx_dspark.train.loop import TrainOptions
    from mlx_dspark.train.losses import LossWeights
    from mlx_dspark.train.session import DataOptions, DraftShape, Precision, train_draft

    train_files, held_out = corpus_files()
    target_dir, draft_dir = args.out / "target", args.out / "draft"
    log(f"corpus: {len(train_files)} training files, {len(held_out)} held out, Python {sys.version.split()[0]}")
    report: dict = {"python": sys.version.split()[0], "train_files": len(train_files), "held_out_files": len(held_out)}
    if not args.measure_only:
        args.work.mkdir(parents=True, exist_ok=True)
        if not args.skip_target:
            tokenizer, ids = train_tokenizer(train_files, args.work / "tokenizer")
            stream = token_stream(tokenizer, train_files, ids["<|endoftext|>"])
            log(f"tokenizer: {VOCAB_SIZE} entries, {len(stream)} training tokens")
            mx.reset_peak_memory()
            model, loss, seconds = train_target(
                stream, steps=args.target_steps, batch=args.target_batch, seq_len=args.target_seq_len,
                lr=args.target_lr, seed=args.seed,
            )  # fmt: skip
            report["target"] = {
                "steps": args.target_steps, "tokens_seen": args.target_steps * args.target_batch * args.target_seq_len,
                "final_loss": round(loss, 3), "seconds": round(seconds), "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
            }  # fmt: skip
            save_target(model, args.work / "tokenizer", target_dir, ids["<|endoftext|>"])
        from tokenizers import Tokenizer

        from mlx_dspark.loading.load import load

        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        target = load(str(target_dir), dtype="float32").target
        records = continuations(target, tokenizer, train_files, count=args.continuations, prompt_len=64, new_tokens=192, seed=args.seed)
        generated = args.work / "continuations.jsonl"
        generated.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        mx.reset_peak_memory()
        started = time.perf_counter()
        train_draft(
            target_dir,
            draft_dir,
            data=DataOptions(
                # a quarter of the training files plus the target's continuations (about a fifth of the chunks)
                train=[str(p) for p in train_files[::4]] + [str(generated)],
                valid=[str(p) for p in held_out],
                seq_len=256,
                batch_size=8,
            ),
            options=TrainOptions(steps=args.draft_steps, anchors=32, lr=3e-3, seed=args.seed, losses=LossWeights()),
            shape=DraftShape(
                num_layers=3, num_taps=3, sliding_window=args.draft_window, markov_rank=64, markov_head_type="vanilla"
            ),
            precision=Precision(target_dtype="float32", save_dtype="float16"),  # float16 matmuls are slow on CPUs
            force=True,
            calibrate="greedy",
        )
        training = json.loads((draft_dir / "training.json").read_text())
        report["draft"] = {"steps": args.draft_steps, "seconds": round(time.perf_counter() - started), **training}
    report["acceptance"] = measure(target_dir, draft_dir, held_out[: args.measure_files], prompt_tokens=128, max_tokens=128)
    report["size_mb"] = {"target": round(directory_mb(target_dir), 2), "draft": round(directory_mb(draft_dir), 2)}
    (args.out / "demo_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
