"""Train an EAGLE-3 draft for the bundled demo target, so the round's choice between heads can be measured
with a real chained head beside the demo's DSpark draft (issue 35.4).

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/train_demo_eagle3.py --out /tmp/bench/demo-eagle3

Corpus: the demo pair's own (scripts/train_demo_pair.py: the stdlib's .py files, every 20th held out). The
draft is speculators' EAGLE-3 layout (models/heads/eagle3/model.py): one qwen3 decoder layer at the target's width, `fc`
over three tapped target states, its own LM head over the full vocabulary (started from the target's tied
embedding), the target's embedding shared (`embed_requires_grad: false`).

Training is EAGLE-3's training-time test, restated from the paper and speculators' trainer: step 0 reads the
target's fused states g_t and the embedding of token t+1 under a causal mask and predicts token t+2; step j
feeds step j-1's own pre-norm output at t with the embedding of token t+1+j, at position t+j, attending to
step 0's keys at positions <= t and to the same chain's keys of steps 1..j (the cache a chained proposal
sees at inference: engine/proposers/chain.py). Each step's loss is the cross-entropy against the target's own
distribution at that position (soft labels), weighted 0.8^j. The teacher inputs are the corpus' tokens.
Held-out acceptance is measured with `mlx_dspark.generate` on prefixes of held-out files at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_demo_pair import corpus_files, read  # noqa: E402  (the demo pair's own corpus split)

from mlx_dspark import load  # noqa: E402
from mlx_dspark.models.heads.eagle3.model import Eagle3Draft  # noqa: E402
from mlx_dspark.models.heads.eagle3.args import Eagle3Args  # noqa: E402
from mlx_dspark.testing.eagle3_tiny import eagle3_config  # noqa: E402

DEMO_TARGET = ROOT / "mlx_dspark" / "demo" / "target"
AUX_LAYER_IDS = (1, 3, 5)  # EAGLE's hidden-state indices (input of layer i): our taps 0, 2, 4 of 6 layers
STEP_WEIGHT = 0.8


def log(message: str) -> None:
    print(f"[eagle3] {message}", file=sys.stderr, flush=True)


def repeat_kv(x: mx.array, times: int) -> mx.array:
    return x if times == 1 else mx.repeat(x, times, axis=1)


def step_qkv(draft: Eagle3Draft, emb: mx.array, hidden: mx.array, offset: int) -> tuple[mx.array, ...]:
    """The layer's inputs and q / k / v (B, heads, L, D) at positions offset .. offset + L - 1."""
    layer = draft.layers[0]
    attn = layer.self_attn
    normed = layer.hidden_norm(hidden)
    residual = normed if layer.norm_before_residual else hidden
    x = mx.concatenate([layer.input_layernorm(emb), normed], axis=-1)
    return (residual, *attn.project(x, offset))


def step_out(draft: Eagle3Draft, residual: mx.array, attended: mx.array) -> mx.array:
    layer = draft.layers[0]
    B, H, L, D = attended.shape
    h = residual + layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, H * D))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def chain_loss(draft: Eagle3Draft, embed, features: mx.array, tokens: mx.array, target_logits: mx.array, steps: int) -> tuple[mx.array, list]:
    """The weighted training-time-test loss over `steps` chained steps and each step's top-1 agreement."""
    B, S = tokens.shape
    L = S - 1 - steps  # chain origins t = 0 .. L-1
    attn = draft.layers[0].self_attn
    groups = attn.n_heads // attn.n_kv_heads
    hidden = draft.fuse(features[:, :L])
    causal = mx.triu(mx.full((L, L), -mx.inf), k=1)
    total, agreement = mx.array(0.0), []
    k0 = v0 = None
    chain_k, chain_v = [], []
    for j in range(steps):
        residual, q, k, v = step_qkv(draft, embed(tokens[:, 1 + j : 1 + j + L]), hidden, offset=j)
        if j == 0:
            k0, v0 = repeat_kv(k, groups), repeat_kv(v, groups)
            attended = mx.fast.scaled_dot_product_attention(q, k0, v0, scale=attn.scale, mask=causal)
        else:
            chain_k.append(repeat_kv(k, groups))
            chain_v.append(repeat_kv(v, groups))
            scores = (q * attn.scale) @ k0.transpose(0, 1, 3, 2) + causal  # step 0's keys at <= t
            own = mx.stack([(q * attn.scale * kk).sum(-1) for kk in chain_k], axis=-1)  # (B, H, L, j)
            weights = mx.softmax(mx.concatenate([scores, own], axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
            attended = weights[..., :L] @ v0 + sum(weights[..., L + i, None] * vv for i, vv in enumerate(chain_v))
        h = step_out(draft, residual, attended)
        logits = draft.logits(h)
        labels = target_logits[:, 1 + j : 1 + j + L]
        soft = mx.softmax(labels.astype(mx.float32), axis=-1)
        loss = -(soft * nn.log_softmax(logits.astype(mx.float32), axis=-1)).sum(-1).mean()
        total = total + STEP_WEIGHT**j * loss
        agreement.append((mx.argmax(logits, -1) == mx.argmax(labels, -1)).astype(mx.float32).mean())
        hidden = h
    return total, agreement


def build(target_config: dict, speculative_tokens: int) -> tuple[dict, Eagle3Draft]:
    config = eagle3_config(
        target_config, draft_vocab_size=target_config["vocab_size"], aux_layer_ids=AUX_LAYER_IDS,
        speculative_tokens=speculative_tokens, layer_type="qwen3", heads=target_config["num_attention_heads"],
        kv_heads=target_config["num_key_value_heads"], head_dim=target_config["head_dim"],
        intermediate_size=target_config["intermediate_size"],
    )  # fmt: skip
    return config, Eagle3Draft(Eagle3Args.from_dict(config))


def save(draft: Eagle3Draft, config: dict, out: Path, dtype: mx.Dtype) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = {name: np.array(value.astype(dtype)) for name, value in tree_flatten(draft.parameters())
               if not name.startswith("embed_tokens")}  # fmt: skip
    V = config["transformer_layer_config"]["vocab_size"]
    weights["d2t"] = np.zeros(V, dtype=np.int64)  # a full-vocabulary draft: row i is target id i
    weights["t2d"] = np.ones(V, dtype=bool)
    config = {**config, "torch_dtype": {mx.float16: "float16", mx.float32: "float32"}[dtype]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def measure(out: Path, files: list[Path], *, prompt_tokens: int, max_tokens: int) -> dict:
    import mlx_dspark

    pair = mlx_dspark.load(str(DEMO_TARGET), draft=str(out), dtype="float32")
    lengths = []
    for path in files:
        ids = pair.tokenizer.encode(read(path), add_special_tokens=False)[:prompt_tokens]
        result = mlx_dspark.generate(pair, ids, max_tokens=max_tokens, temperature=0.0, max_draft_tokens=pair.heads["eagle3"].args.speculative_tokens, lookup="off")
        lengths.extend(result.acceptance_lengths)
    return {"greedy_mean_acceptance_length": round(sum(lengths) / max(len(lengths), 1), 3), "rounds": len(lengths), "files": len(files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--chain", type=int, default=3, help="training-time-test steps (the draft's speculative_tokens)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-files", type=int, default=12)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} exists and is not empty: choose another --out")
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    pair = load(str(DEMO_TARGET), dtype="float32")
    target = pair.target
    target_config = json.loads((DEMO_TARGET / "config.json").read_text())
    train_files, held_out = corpus_files()
    log(f"encoding {len(train_files)} training files")
    stream = np.concatenate([np.array(pair.tokenizer.encode(read(p), add_special_tokens=False) + [0], dtype=np.int32)
                             for p in train_files])  # fmt: skip
    config, draft = build(target_config, args.chain)
    draft.lm_head.weight = mx.array(target.embed(mx.arange(target_config["vocab_size"])[None])[0])  # tied start
    taps = Eagle3Args.from_dict(config).tap_ids(target_config["num_hidden_layers"])
    embed = target.embed
    loss_and_grad = nn.value_and_grad(draft, lambda d, f, t, lg: chain_loss(d, embed, f, t, lg, args.chain)[0])
    warmup = min(30, args.steps // 2)
    schedule = optim.join_schedules([optim.linear_schedule(0.0, args.lr, max(warmup, 1)),
                                     optim.cosine_decay(args.lr, max(args.steps - warmup, 1), 1e-2 * args.lr)], [warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(stream) - args.seq_len, size=args.batch)
        tokens = mx.array(np.stack([stream[s : s + args.seq_len] for s in starts]))
        logits, features = target(tokens, tap_ids=taps)
        logits, features = mx.stop_gradient(logits), mx.stop_gradient(features)
        loss, grads = loss_and_grad(draft, features, tokens, logits)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(draft, grads)
        mx.eval(draft.parameters(), optimizer.state, loss)
        if step % 50 == 0 or step == 1:
            _, agreement = chain_loss(draft, embed, features, tokens, logits, args.chain)
            top1 = " ".join(f"{float(a):.3f}" for a in agreement)
            log(f"step {step}/{args.steps} loss {float(loss):.3f} top-1 per step {top1} ({time.perf_counter() - started:.0f} s)")
    save(draft, config, args.out, mx.float16)
    report = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "chain": args.chain, "lr": args.lr,
              "wall_seconds": round(time.perf_counter() - started, 1),
              "held_out": measure(args.out, held_out[: args.measure_files], prompt_tokens=128, max_tokens=96)}  # fmt: skip
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(json.dumps(report))


if __name__ == "__main__":
    main()
