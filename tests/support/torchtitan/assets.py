"""A tiny tokenizer and text dataset that TorchTitan 0.2.2 loads offline (its wheel ships neither).

    python tests/support/torchtitan/assets.py OUT_DIR

writes

* ``OUT_DIR/tokenizer/tokenizer.json`` and ``tokenizer_config.json``: a
  ``tokenizers`` word-level model with a whitespace pre-tokenizer, the three
  special tokens TorchTitan's ``HuggingFaceTokenizer`` looks for, and 512
  synthetic words: 515 ids, below the 2048-entry vocabulary of llama3's
  ``debugmodel`` (which does not size its embedding from the tokenizer);
* ``OUT_DIR/c4_test/data.json``: JSON lines ``{"text": ...}`` with Zipf word
  frequencies (so the loss moves), the layout of TorchTitan's own
  ``tests/assets/c4_test``, read through ``training.dataset = "c4_test"`` and
  ``training.dataset_path``.

Everything is a pure function of ``seed``: two calls write identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Assets", "make_assets"]

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
_SYLLABLES = ["ka", "lo", "mi", "tu", "re", "sa", "no", "vi", "de", "pu", "gra", "shi", "on", "el", "ar", "us"]


@dataclass(frozen=True)
class Assets:
    """Where the generated files are, as TorchTitan's config keys want them."""

    hf_assets_path: Path
    """``[model] hf_assets_path``: the tokenizer directory."""
    dataset_path: Path
    """``[training] dataset_path`` (with ``dataset = "c4_test"``)."""

    def overrides(self) -> list[str]:
        """The TorchTitan command-line flags that point a job at these assets."""
        return ["--model.hf_assets_path", str(self.hf_assets_path), "--training.dataset_path", str(self.dataset_path)]


def _words(n: int) -> list[str]:
    out = []
    for i in range(n):
        a, b, c = _SYLLABLES[i % 16], _SYLLABLES[(i // 16) % 16], _SYLLABLES[(i // 256) % 16]
        out.append(a + b + (c if i >= 256 else ""))
    return out


def make_assets(out_dir: Path, *, docs: int = 400, words: int = 512, seed: int = 0) -> Assets:
    """Write the tokenizer and the dataset under ``out_dir``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocabulary = _words(words)
    ids = {UNK: 0, BOS: 1, EOS: 2, **{w: i + 3 for i, w in enumerate(vocabulary)}}
    tokenizer_dir = out_dir / "tokenizer"
    data_dir = out_dir / "c4_test"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(WordLevel(vocab=ids, unk_token=UNK))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(words)]
    lines = [json.dumps({"text": " ".join(rng.choices(vocabulary, weights=weights, k=rng.randint(40, 160)))}) for _ in range(docs)]
    (data_dir / "data.json").write_text("\n".join(lines) + "\n")
    return Assets(tokenizer_dir, data_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    assets = make_assets(args.out_dir, docs=args.docs, seed=args.seed)
    print(" ".join(assets.overrides()))
