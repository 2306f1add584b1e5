"""The Megatron-LM command lines of the tests and the benchmark (for :mod:`.pretrain_gpt_lm`), sized for CPU."""

from __future__ import annotations

__all__ = ["ITERATIONS", "LAYOUTS", "MEGATRON_LM_ARGS"]

ITERATIONS = 10

MEGATRON_LM_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "0.0", "--hidden-dropout", "0.1",
    "--attention-dropout", "0.1", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--split", "1,0,0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
    "--position-embedding-type", "learned_absolute", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--test-workdir", ".",
]  # fmt: skip
"""Megatron-LM flags as its GPT examples write them, sized for CPU (no gradient clipping: it asserts CUDA tensors)."""

LAYOUTS = {
    "tp2dp2": ["--tensor-model-parallel-size", "2"],
    "dp4-distopt": ["--use-distributed-optimizer"],
    "dp2x2-distopt-instances": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
}
"""Parallel layouts on 4 ranks: TP 2 x DP 2; DP 4, distributed optimizer; DP 2 x 2 distributed-optimizer instances."""
