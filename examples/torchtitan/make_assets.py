"""Offline stand-ins for the assets torchtitan's debug config reads from its source tree (tests/assets/, not in
the wheel): ``DIR/c4_test/data.json`` (2,000 rows of synthetic text) and ``DIR/tokenizer/`` (a byte-level BPE
of 512 tokens trained on them). Deterministic. Usage: ``python make_assets.py DIR``."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = [
    *("the", "a", "model", "checkpoint", "shard", "tensor", "rank", "save", "load", "resume", "train", "step"),
    *("data", "token", "optimizer", "weight", "bias", "gradient", "loss", "layer"),
]
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}


def main(out: Path) -> None:
    rng = random.Random(0)
    rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 200))) for _ in range(2000)]
    (out / "c4_test").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "c4_test" / "data.json").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(rows, trainer)
    tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {**SPECIAL, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
