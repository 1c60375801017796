"""Sketch of an ESM-2 worker: per-protein embeddings, the mean of the residues' last hidden states.

Not run by the tests (no GPU, no weights here); it shows the shape of a protein model worker that the
minilm demo stands in for. The embedding function is a plain function of a list of sequences.
"""

import importlib.util
import os
import sys

WINDOW = 1022  # ESM-2 has 1,024 positions; <cls> and <eos> take two
STRIDE = 511


def windows(length):
    if length <= WINDOW:
        return [(0, length)]
    return [(start, start + WINDOW) for start in [*range(0, length - WINDOW, STRIDE), length - WINDOW]]


def embed(model, tokenizer, sequences, device):
    """Each sequence's embedding: its residues' mean over overlapping windows, each weighted by its length."""
    import torch

    out = []
    with torch.inference_mode():
        for sequence in sequences:
            total, weight = 0, 0
            for start, stop in windows(len(sequence)):
                batch = tokenizer([sequence[start:stop]], return_tensors="pt").to(device)
                hidden = model(**batch).last_hidden_state[0, 1:-1]  # the residues, not <cls> and <eos>
                total, weight = total + hidden.sum(0), weight + hidden.shape[0]
            out.append((total / weight).float().cpu().tolist())
    return out


def main():
    socket_path, weights_root = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    from transformers import AutoTokenizer, EsmModel  # the model's own stack, present only in its environment

    tokenizer = AutoTokenizer.from_pretrained(weights_root, local_files_only=True)
    model = EsmModel.from_pretrained(weights_root, local_files_only=True).to("cuda").eval()

    def on_predict(payload):
        sequences = payload["inputs"]  # already ruled by [inputs]: residue letters only
        vectors = embed(model, tokenizer, sequences, "cuda")
        return {"items": [{"embedding": vector, "tokens": len(sequence), "windows": len(windows(len(sequence)))}
                          for vector, sequence in zip(vectors, sequences, strict=True)]}

    worker_base.serve(slug="esm2", socket_path=socket_path, on_predict=on_predict)


if __name__ == "__main__":
    main()
