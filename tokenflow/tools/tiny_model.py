"""Make a tiny Llama-architecture model directory with no download.

Seeded random weights saved as safetensors (real weights, not vLLM's dummy
loader, whose degenerate outputs hide KV bugs), a byte-level BPE tokenizer
trained on text generated here, and a chat template. Same seed, same files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("TOKENFLOW_MODEL_DIR", "models/tiny-llama"))
MODEL_NAME = "tiny-llama"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (
    "the a reader token stream buffer engine request user answer time fast slow "
    "model serve burst wait first pause resume memory cache host device block "
    "read write tokens per second rate queue schedule run stop start one two three "
    "river mountain light dark morning evening paper story question because while "
    "when then and or but if so very more less new old good small large quick"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]) + f" {rng.randint(0, 999)}")
    return lines


def _build_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


# Layer shapes of the tiny model and of a Llama-3-8B-shaped one (the GPU check).
TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4,  # head size 64: supported by the CPU backend
                  num_key_value_heads=2, max_position_embeddings=4096)
LLAMA3_8B_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0)


def _build_weights(out: Path, seed: int, vocab: int, shape: dict = TINY_SHAPE,
                   dtype: str = "float32", device: str = "cpu") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        **shape,
        initializer_range=0.1,  # peakier attention: outputs depend on the whole context
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():
        # Never prefer EOS under greedy decoding, so answers run to max_tokens
        # and tests know their lengths.
        model.lm_head.weight[config.eos_token_id].zero_()
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4GB")


def make_random_llama(out_dir: str | Path, shape: dict, seed: int = 0, dtype: str = "bfloat16",
                      device: str = "cpu", name: str = "random-llama") -> Path:
    """A Llama of the given layer shape with seeded random weights and the
    tiny model's tokenizer, written atomically; reused when complete."""
    out = Path(out_dir)
    if (out / "tokenflow.json").exists() and not force_rebuild(out, seed, name):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        _build_tokenizer(tmp, seed)
        vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
        _build_weights(tmp, seed, vocab, shape, dtype, device)
        (tmp / "tokenflow.json").write_text(json.dumps({"seed": seed, "name": name}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def force_rebuild(out: Path, seed: int, name: str) -> bool:
    """A model directory made with another seed or name is rebuilt."""
    meta = json.loads((out / "tokenflow.json").read_text())
    return meta.get("seed") != seed or meta.get("name") != name


def make_tiny_model(out_dir: str | Path = DEFAULT_DIR, seed: int = 0, force: bool = False) -> Path:
    """Write the model to out_dir (atomically); reuse a complete one unless force."""
    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists() and not force:
        return out
    if force and out.exists():
        shutil.rmtree(out)
    return make_random_llama(out, TINY_SHAPE, seed, dtype="float32", name=MODEL_NAME)
