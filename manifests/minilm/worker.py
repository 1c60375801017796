"""all-MiniLM-L6-v2 as a resident worker: load once, embed many.

argv: <socket> <weights_root>. Payload: {"inputs": [str, ...]}; result:
{"items": [{"embedding": [...384 floats], "tokens": n, "truncated": bool}], ...}.
With "encoding": "array" the result is {"embeddings": float32 array [n, 384],
"items": [{"tokens": n, "truncated": bool}], ...}: the array travels beside the
line as an attachment, and the client gets a numpy array. With "encoding":
"float32-base64" each item carries "embedding_f32" instead: the 384 float32
values, little-endian, base64. JSON's float text costs more than the model
itself for large batches.
"""

import base64
import importlib.util
import os
import sys
import time

# Weights are never fetched: the pinned copy on disk is the only source.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_worker_base():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(weights_root):
    """The load stage: the model read into host memory, on the CPU.

    With ``[lifecycle] load = "load"`` the pool's zygote runs it once, before it forks, and
    every worker shares the weights copy-on-write; otherwise the worker runs it itself.
    """
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(weights_root, device="cpu")


def main():
    socket_path, weights_root = sys.argv[1], sys.argv[2]
    worker_base = load_worker_base()
    started = time.monotonic()
    import numpy
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    staged = worker_base.staged()
    model = (staged if staged is not None else load(weights_root)).to(device)  # the to_device stage
    max_tokens = model.max_seq_length
    model.encode(["warm up"])  # the first pass allocates; pay it before the first request
    load_s = time.monotonic() - started
    how = "staged in its zygote" if staged is not None else f"loaded from {weights_root}"
    print(f"minilm: {how}, on {device}, ready in {load_s:.1f} s", flush=True)

    def on_predict(payload):
        inputs = payload.get("inputs") if isinstance(payload, dict) else None
        if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
            raise ValueError('payload must be {"inputs": [str, ...]}')
        if not inputs:
            return {"items": [], "dim": 384}
        tokens = [len(ids) for ids in model.tokenizer(inputs, add_special_tokens=True)["input_ids"]]
        vectors = model.encode(inputs, batch_size=int(payload.get("batch_size", 32)), normalize_embeddings=True)
        if payload.get("encoding") == "array":
            # One float32 [n, 384] array: it travels beside the line as an
            # attachment (a list of floats to a client that did not ask for arrays).
            items = [{"tokens": count, "truncated": count > max_tokens} for count in tokens]
            return {"embeddings": numpy.ascontiguousarray(vectors, dtype=numpy.float32), "items": items,
                    "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device}
        if payload.get("encoding") == "float32-base64":
            items = [
                {"embedding_f32": base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii"),
                 "tokens": count, "truncated": count > max_tokens}
                for vector, count in zip(vectors, tokens, strict=True)
            ]
            return {"items": items, "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device}
        digits = int(payload.get("digits", 5))
        items = [
            {"embedding": [round(float(x), digits) for x in vector], "tokens": count, "truncated": count > max_tokens}
            for vector, count in zip(vectors, tokens, strict=True)
        ]
        return {"items": items, "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device}

    def ready():
        return {"device": device, "load_s": round(load_s, 3), "max_tokens": max_tokens}

    worker_base.serve(slug="minilm", socket_path=socket_path, on_predict=on_predict, ready=ready)


if __name__ == "__main__":
    main()
