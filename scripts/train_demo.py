"""Trains the built-in demo model and its 2-layer draft on the demo corpus, on the CPU, in minutes.

Both are `transformers` Qwen3ForCausalLM models with the shapes that `nanoserve.model.demo` declares,
trained from scratch in fp32 with plain torch: AdamW, linear warmup then cosine decay, gradient
clipping, a fixed seed. The corpus (`nanoserve/model/demo/corpus.txt`, from make_demo_corpus.py) is
tokenized with the demo tokenizer and packed into one token stream (documents end with
<|endoftext|>); each step draws random windows from it and the loss covers every token. The last
documents (~3%) are held out for the reported losses and the draft's greedy agreement with the target.

Writes, under --out: model.safetensors and draft.safetensors (bf16, Hugging Face tensor names, tied
embeddings so no lm_head.weight) and train_log.json (configs, hyperparameters, per-step losses, wall
times, the command, and the sha256 of the tokenizer.json the weights were trained with, which
`nanoserve.model.demo` checks); and the loss curves as a PNG (--plot).

With --distill W (0 < W <= 1) the draft learns from the target as well as from the corpus
(knowledge distillation, Hinton et al. 2015; for drafts, DistillSpec, Zhou et al. 2024): its loss is
(1 - W) * cross-entropy + W * KL(target || draft), both over every position of the same windows, the
target (bf16 weights in fp32) run without gradients. W = 0 is plain next-token training; W = 1 (the
KL term alone), the default, gave the highest agreement with the target (docs/speculative.md).

With --draft-only, only the draft is trained: the target is read from --out's model.safetensors and
its entries of train_log.json are kept (the draft's command goes under "draft_command").

Usage: python scripts/train_demo.py [--steps N] [--draft-steps N] [--distill W] [--draft-only] ...
transformers and matplotlib are dev-time dependencies (pip install -e '.[test]' matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from nanoserve.model.demo import (
    CORPUS_PATH,
    END_OF_TEXT,
    IM_END_ID,
    TRAIN_LOG_PATH,
    WEIGHTS_DIR,
    demo_config_dict,
    demo_draft_config_dict,
    tokenizer_sha256,
    train_demo_tokenizer,
)

REPO = Path(__file__).resolve().parent.parent
HELD_OUT_FRACTION = 0.03
SAMPLE_QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What is 7 + 5?",
                    "Who are you?", "Tell me a story about a fox.", "What is the meaning of life?")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyperparameters of one training run; the learning rate peaks at `lr` after `warmup` steps and
    decays by a cosine to `lr * min_lr_ratio` at `steps`."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 20240607
    distill: float = 0.0  # weight of KL(teacher || model) against the cross-entropy (draft only)


def split_corpus(text: str) -> int:
    """Character offset where the held-out part starts: the first document boundary after
    (1 - HELD_OUT_FRACTION) of the text."""
    marker = END_OF_TEXT + "\n"
    return text.index(marker, int(len(text) * (1 - HELD_OUT_FRACTION))) + len(marker)


def build_model(config: dict[str, Any]) -> transformers.Qwen3ForCausalLM:
    """An fp32 Qwen3ForCausalLM with the given config.json contents, initialised from the current seed."""
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "torch_dtype"})
    return transformers.Qwen3ForCausalLM(hf_config).float()


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at `step`: linear warmup, then cosine down to cfg.min_lr_ratio."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def next_token_loss(model: transformers.Qwen3ForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def distill_loss(model: transformers.Qwen3ForCausalLM, teacher: transformers.Qwen3ForCausalLM,
                 windows: torch.Tensor, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1 - cfg.distill) * cross-entropy + cfg.distill * KL(teacher || model), each a mean over the
    positions of windows[:, :-1]; returns that loss and its cross-entropy and KL parts (detached)."""
    inputs = windows[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(input_ids=inputs).logits.flatten(0, 1)
    logits = model(input_ids=inputs).logits.flatten(0, 1)
    ce = F.cross_entropy(logits, windows[:, 1:].flatten())
    kl = F.kl_div(F.log_softmax(logits, dim=-1), F.log_softmax(teacher_logits, dim=-1), reduction="batchmean",
                  log_target=True)
    return (1 - cfg.distill) * ce + cfg.distill * kl, ce.detach(), kl.detach()


def train(model: transformers.Qwen3ForCausalLM, tokens: torch.Tensor, cfg: TrainConfig, name: str,
          teacher: transformers.Qwen3ForCausalLM | None = None) -> dict[str, Any]:
    """Trains `model` in place on random windows of `tokens` (distilling from `teacher` when
    cfg.distill > 0); returns per-step losses (of the objective, plus its cross-entropy and KL parts
    when distilling) and timings."""
    if cfg.distill > 0 and teacher is None:
        raise ValueError("distillation needs a teacher model")
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
    offsets = torch.arange(cfg.seq_len + 1)
    losses: list[float] = []
    ce_losses: list[float] = []
    kl_losses: list[float] = []
    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size, 1), generator=gen)
        if cfg.distill > 0:
            loss, ce, kl = distill_loss(model, teacher, tokens[starts + offsets], cfg)
            ce_losses.append(round(ce.item(), 4))
            kl_losses.append(round(kl.item(), 4))
        else:
            loss = next_token_loss(model, tokens[starts + offsets])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if step % 25 == 0 or step == cfg.steps - 1:
            elapsed = time.perf_counter() - start
            rate = (step + 1) * cfg.batch_size * cfg.seq_len / elapsed
            parts = f" (ce {ce_losses[-1]:.3f} kl {kl_losses[-1]:.3f})" if cfg.distill > 0 else ""
            print(f"{name} step {step:4d}/{cfg.steps} loss {losses[-1]:.3f}{parts} lr {sched.get_last_lr()[0]:.2e} "
                  f"{rate:.0f} tok/s {elapsed:.0f}s", flush=True)
    wall = time.perf_counter() - start
    model.eval()
    parts = {"ce_losses": ce_losses, "kl_losses": kl_losses} if cfg.distill > 0 else {}
    return {"losses": losses, **parts, "wall_s": round(wall, 1),
            "tokens_per_s": round(cfg.steps * cfg.batch_size * cfg.seq_len / wall)}


def round_to_bf16(model: transformers.Qwen3ForCausalLM) -> None:
    """Rounds the parameters through bf16 in place, so evaluation sees exactly the shipped weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def held_out_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The held-out stream cut into consecutive windows of seq_len + 1 tokens (the tail is dropped)."""
    n = (len(tokens) - 1) // seq_len
    return torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate(target: transformers.Qwen3ForCausalLM, draft: transformers.Qwen3ForCausalLM,
             windows: torch.Tensor) -> dict[str, float]:
    """Held-out losses of both models, the target's greedy next-token accuracy, and how often the
    draft's greedy next token equals the target's (what speculative decoding accepts)."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    target_logits, draft_logits = target(input_ids=inputs).logits, draft(input_ids=inputs).logits
    target_next, draft_next = target_logits.argmax(-1), draft_logits.argmax(-1)
    return {
        "target_held_out_loss": round(F.cross_entropy(target_logits.flatten(0, 1), labels.flatten()).item(), 4),
        "draft_held_out_loss": round(F.cross_entropy(draft_logits.flatten(0, 1), labels.flatten()).item(), 4),
        "target_greedy_accuracy": round((target_next == labels).float().mean().item(), 4),
        "draft_greedy_agreement": round((draft_next == target_next).float().mean().item(), 4),
        "held_out_positions": labels.numel(),
    }


@torch.no_grad()
def chat_samples(model: transformers.Qwen3ForCausalLM, tok: tokenizers.Tokenizer) -> list[dict[str, str]]:
    """Greedy answers (up to 80 tokens) to SAMPLE_QUESTIONS, asked as one-turn ChatML conversations."""
    samples = []
    for question in SAMPLE_QUESTIONS:
        prompt = tok.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n").ids
        out = model.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=IM_END_ID,
                             pad_token_id=IM_END_ID)
        samples.append({"user": question, "assistant": tok.decode(out[0, len(prompt):].tolist())})
    return samples


def save_weights(model: transformers.Qwen3ForCausalLM, path: Path) -> None:
    """bf16 safetensors with HF names; the tied lm_head.weight is left out, as in HF checkpoints."""
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
             if name != "lm_head.weight"}
    save_file(state, str(path), metadata={"format": "pt"})


def plot_losses(log: dict[str, Any], path: Path) -> None:
    """Both models' training cross-entropy (per step, and a moving average) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, colour in (("target", "tab:blue"), ("draft", "tab:orange")):
        run = log[name]
        losses = torch.tensor(run.get("ce_losses") or run["losses"])  # a distilled draft's CE part
        tokens = torch.arange(1, len(losses) + 1) * run["train"]["batch_size"] * run["train"]["seq_len"] / 1e6
        window = min(10, len(losses))
        smooth = torch.nn.functional.avg_pool1d(losses[None, None], window, stride=1).flatten()
        shape = run["config"]
        label = (f"{name}: {shape['num_hidden_layers']} layers x {shape['hidden_size']} "
                 f"({run['params'] / 1e6:.1f}M params)")
        ax.plot(tokens, losses, color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(tokens[window - 1:], smooth, color=colour, label=label)
        ax.axhline(log["eval"][f"{name}_held_out_loss"], color=colour, linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_yticks([0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 8])
    ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token, log scale)")
    ax.set_title("nanoserve demo model: training loss (dotted: held-out loss of the shipped bf16 weights)")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="target model optimizer steps")
    parser.add_argument("--draft-steps", type=int, default=1000, help="draft model optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=20240607)
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="folder for the weights and train_log.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "demo_training_loss.png")
    parser.add_argument("--draft-only", action="store_true",
                        help="train only the draft, against the target already in --out")
    parser.add_argument("--distill", type=float, default=1.0, metavar="WEIGHT",
                        help="weight in [0, 1] of KL(target || draft) in the draft's loss (0: cross-entropy only)")
    args = parser.parse_args()
    if not 0 <= args.distill <= 1:
        parser.error("--distill must be in [0, 1]")
    return args


def load_target(path: Path, vocab_size: int) -> transformers.Qwen3ForCausalLM:
    """The shipped target from its bf16 safetensors (tied head), in fp32, for evaluation."""
    model = build_model(demo_config_dict(vocab_size))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"{path} does not hold the demo model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    tok = train_demo_tokenizer()
    text = CORPUS_PATH.read_text(encoding="utf-8")
    cut = split_corpus(text)
    train_tokens = torch.tensor(tok.encode(text[:cut]).ids)
    held_out = held_out_windows(torch.tensor(tok.encode(text[cut:]).ids), args.seq_len)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    print(f"corpus: {len(train_tokens)} training tokens, {held_out[:, 1:].numel()} held out", flush=True)

    command = shlex.join(["python", "scripts/train_demo.py", *sys.argv[1:]])
    if args.draft_only:
        log = json.loads((args.out / TRAIN_LOG_PATH.name).read_text(encoding="utf-8"))
        if log["tokenizer_sha256"] != tokenizer_sha256(tok) or log["corpus_sha256"] != hashlib.sha256(
                text.encode()).hexdigest():
            raise SystemExit("the target in --out was trained on another tokenizer or corpus; retrain both")
        models = {"target": load_target(args.out / "model.safetensors", vocab_size)}
        log["draft_command"] = command
        runs = [("draft", demo_draft_config_dict, args.draft_steps)]
    else:
        log = {"command": command}
        models = {}
        runs = [("target", demo_config_dict, args.steps), ("draft", demo_draft_config_dict, args.draft_steps)]
    log.update({
        "tokenizer_sha256": tokenizer_sha256(tok),
        "corpus_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "corpus_bytes": len(text.encode()),
        "train_tokens": len(train_tokens),
        "held_out_from_char": cut,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "threads": torch.get_num_threads(),
    })
    for name, make_config, steps in runs:
        config = make_config(vocab_size)
        cfg = TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                          warmup=max(1, steps // 20), seed=args.seed, distill=args.distill if name == "draft" else 0.0)
        torch.manual_seed(cfg.seed)
        model = build_model(config)
        run = train(model, train_tokens, cfg, name, teacher=models.get("target"))
        round_to_bf16(model)
        models[name] = model
        log[name] = {"config": config, "params": sum(p.numel() for p in model.parameters()),
                     "train": dataclasses.asdict(cfg), **run}
    log["eval"] = evaluate(models["target"], models["draft"], held_out)
    wall = round(time.perf_counter() - start, 1)
    if args.draft_only:
        log["draft_wall_s"] = wall
    else:
        log["samples"] = chat_samples(models["target"], tok)
        log["wall_s"] = wall
    print(json.dumps({"eval": log["eval"], "samples": log["samples"], "wall_s": wall}, indent=2, ensure_ascii=False))

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.draft_only:
        save_weights(models["target"], args.out / "model.safetensors")
    save_weights(models["draft"], args.out / "draft.safetensors")
    (args.out / TRAIN_LOG_PATH.name).write_text(json.dumps(log, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot_losses(log, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
