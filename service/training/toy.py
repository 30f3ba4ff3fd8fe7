"""The toy induction series: a 2-layer attention-only Llama trained on repeated random tokens.

Each training sequence is ``<bos> + r + r``, r = L word tokens drawn uniformly (L varies by batch,
from ``MIN_COPY`` to ``max_copy``): the second copy is predictable only by looking back at what followed the
earlier copy of the current token, which is what an induction head does (Olsson et al. 2022). A
previous-token head in layer 0 and an induction head in layer 1 form there; their scores jump
together with the loss in a phase change.

Attention-only: the Llama family has no switch for its MLP, so each block's MLP (4 units wide) has
its weights set to zero and frozen: its output is exactly 0 (``down(silu(gate(x)) · up(x))`` with a
zero ``down``). Weights start at a standard deviation of 0.1 (Llama's default 0.02 leaves the
attention logits so small that the heads stay uniform for thousands of steps on this task); RoPE
lets a head find the previous token without learning positions first.
The tokenizer is a word-level one (``w0`` … ``w{V-1}``, ``<bos>``, ``<pad>``, ``<unk>``) saved
with every checkpoint, so every checkpoint cuts the same windows from a corpus.

Checkpoints are saved at log-spaced steps as folders ``step-NNNNNN`` (config, weights, tokenizer,
``trainer_state.json`` with ``global_step``), beside ``corpus.txt``: documents of the same kind
drawn with another seed, one per line, for ``headatlas analyze corpus.txt --checkpoints OUT``.

Pure computation: torch and transformers only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from headatlas.service.errors import Param, ParameterError

MIN_COPY = 8  # the shortest r of training
CORPUS_SEED_OFFSET = 1_000_003  # the corpus is drawn apart from the training data
SPECIALS = ("<pad>", "<bos>", "<unk>")


@dataclass(frozen=True)
class ToySpec:
    """What is trained and saved. Defaults: 1,500 steps, one to three minutes on one core."""

    steps: int = 1500
    seed: int = 0
    vocab: int = 64  # word tokens
    layers: int = 2
    heads: int = 4
    hidden: int = 64
    batch: int = 16
    lr: float = 3e-3
    init: float = 0.1  # standard deviation of the initial weights
    max_copy: int = 32  # the longest r of training, and r of the corpus (analyse with --probe-length 32)
    checkpoints: int = 12  # log-spaced, step 0 and the last included
    extra: tuple[int, ...] = ()  # steps saved besides the log-spaced ones (where a phase change is looked at closely)
    documents: int = 96  # of corpus.txt (at least 4 × 16 replicate groups: intervals by document)

    def __post_init__(self) -> None:
        for name, least in (("steps", 1), ("checkpoints", 2), ("vocab", 8), ("documents", 1), ("max_copy", MIN_COPY)):
            value = getattr(self, name)
            if value < least:
                raise ParameterError(Param(name, value), f": must be at least {least}")
        if self.hidden % self.heads:
            raise ParameterError(Param("hidden", self.hidden), f": must be a multiple of the {self.heads} heads")


def checkpoint_steps(steps: int, count: int) -> list[int]:
    """``count`` steps from 0 to ``steps``, log-spaced (0, then geometric from 1): fewer where
    rounding makes two equal."""
    if count < 2:
        return [0, steps]
    ladder = [round(math.exp(math.log(steps) * k / (count - 2))) for k in range(count - 1)] if steps > 1 else [1]
    return sorted({0, *ladder, steps})


def word(i: int) -> str:
    return f"w{i}"


def toy_tokenizer(vocab: int):
    """A word-level fast tokenizer: ``<pad>`` 0, ``<bos>`` 1, ``<unk>`` 2, then ``w0`` …."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {tok: i for i, tok in enumerate(SPECIALS)}
    ids.update({word(i): len(SPECIALS) + i for i in range(vocab)})
    core = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


def toy_config(spec: ToySpec):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(SPECIALS) + spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=4,  # the MLP is zeroed and frozen: kept minimal
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max(128, 2 * spec.max_copy + 1),
        initializer_range=spec.init,
        tie_word_embeddings=True,
        bos_token_id=SPECIALS.index("<bos>"),
        eos_token_id=SPECIALS.index("<bos>"),
        pad_token_id=SPECIALS.index("<pad>"),
        attn_implementation="eager",
    )


def repeated_batch(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """``[batch, 1 + 2·length]`` int64: ``<bos> + r + r``, r uniform over the word tokens."""
    r = torch.randint(vocab, (batch, length), generator=generator) + len(SPECIALS)
    bos = torch.full((batch, 1), SPECIALS.index("<bos>"), dtype=torch.long)
    return torch.cat([bos, r, r], dim=1)


def corpus_lines(spec: ToySpec) -> list[str]:
    """The analysis corpus: ``documents`` documents r r (r of ``max_copy`` words), its own seed."""
    generator = torch.Generator().manual_seed(spec.seed + CORPUS_SEED_OFFSET)
    ids = repeated_batch(generator, spec.documents, spec.max_copy, spec.vocab)[:, 1:] - len(SPECIALS)
    return [" ".join(word(int(i)) for i in row) for row in ids]


def _attention_only(model) -> None:
    """Every block's MLP set to zero and frozen: its output is exactly 0."""
    for block in model.model.layers:
        for param in block.mlp.parameters():
            param.requires_grad_(False)
            param.zero_()


def train_toy(
    out: str | Path, spec: ToySpec = ToySpec(), *, progress: Callable[[int, float], None] | None = None
) -> list[Path]:
    """Train the toy and save its checkpoints under ``out`` (created; refused where it holds
    checkpoints already). Returns the checkpoint folders in step order; ``progress(step, loss)``
    hears each checkpoint as it is saved (the loss of the batch at that step)."""
    from transformers import LlamaForCausalLM

    root = Path(out)
    if root.exists() and any(root.glob("step-*")):
        raise ParameterError(f"{str(root)!r} holds checkpoints already; pass a new folder (or delete that one)")
    root.mkdir(parents=True, exist_ok=True)
    # documents separated by blank lines (a .txt corpus), one window each
    (root / "corpus.txt").write_text("\n\n".join(corpus_lines(spec)) + "\n", encoding="utf-8")
    tokenizer = toy_tokenizer(spec.vocab)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(toy_config(spec))
    _attention_only(model)
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    saves = set(checkpoint_steps(spec.steps, spec.checkpoints)) | {s for s in spec.extra if 0 <= s <= spec.steps}
    saved: list[Path] = []
    loss_value = float("nan")
    model.train()
    for step in range(spec.steps + 1):
        if step in saves:
            saved.append(_save(root, step, model, tokenizer, spec, loss_value))
            if progress is not None:
                progress(step, loss_value)
        if step == spec.steps:
            break
        length = int(torch.randint(MIN_COPY, spec.max_copy + 1, (1,), generator=generator))
        ids = repeated_batch(generator, spec.batch, length, spec.vocab)
        loss = model(input_ids=ids, labels=ids).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        # the loss said at a checkpoint: a running mean over about the last 20 batches
        now = float(loss.detach())
        loss_value = now if math.isnan(loss_value) else 0.95 * loss_value + 0.05 * now
    return saved


def _save(root: Path, step: int, model, tokenizer, spec: ToySpec, loss: float) -> Path:
    folder = root / f"step-{step:06d}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = {"global_step": step, "loss": None if math.isnan(loss) else loss, "toy": asdict(spec)}
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    return folder
