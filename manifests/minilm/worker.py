"""all-MiniLM-L6-v2 as a resident worker: load once, embed many.

A sentence model used as a stand-in for a protein model, so the demo runs on
any CPU: it was trained on English, not on proteins. A protein is read one
token per residue (the model's vocabulary holds every single letter), in
windows of 254 residues that overlap by half, so every residue counts; a long
one is the mean of its windows, each weighted by its length. Text is read
with the model's own tokenizer, in the same windows.

argv: <socket> <weights_root>. Payload: {"inputs": [str, ...], "kind": "protein" (default) or "text"};
result: {"items": [{"embedding": [...384 floats], "tokens": n, "windows": w, "unknown_tokens": u}], ...}:
``tokens`` the input's own tokens (a protein's residues), ``windows`` the model passes it took,
``unknown_tokens`` those the vocabulary does not hold. With "encoding": "array" the result is
{"embeddings": float32 array [n, 384], "items": [{"tokens", "windows", "unknown_tokens"}], ...}: the array
travels beside the line as an attachment, and the client gets a numpy array. With "encoding":
"float32-base64" each item carries "embedding_f32" instead: the 384 float32 values, little-endian, base64.
JSON's float text costs more than the model itself for large batches.
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

# The model has 256 positions; [CLS] and [SEP] take two. A stride of half a window reads every residue, bar the
# first and last 127, with at least 63 neighbours on each side in some window.
WINDOW = 254
STRIDE = 127
KINDS = ("protein", "text")


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


def windows(length, window=WINDOW, stride=STRIDE):
    """(start, stop) of each window over ``length`` tokens: one when it fits, else every ``stride``, the last one
    ending at the end (never a stub of a few tokens)."""
    if length <= window:
        return [(0, length)]
    starts = [*range(0, length - window, stride), length - window]
    return [(start, start + window) for start in starts]


def token_ids(tokenizer, texts, kind):
    """Each text's token ids (no [CLS] or [SEP]) and how many of them are [UNK]; ValueError names a bad input."""
    unknown_id = tokenizer.unk_token_id
    if kind == "text":
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        for position, found in enumerate(ids):
            if not found:
                raise ValueError(f"input {position + 1} holds no text")
        return ids, [row.count(unknown_id) for row in ids]
    vocabulary = tokenizer.get_vocab()
    letters = {letter: vocabulary.get(letter.lower(), unknown_id) for letter in map(chr, range(65, 91))}
    letters.update({letter.lower(): token for letter, token in letters.items()})
    ids = []
    for position, text in enumerate(texts):
        try:
            ids.append([letters[letter] for letter in text])
        except KeyError as missing:
            raise ValueError(f"input {position + 1}: {missing.args[0]!r} is not a residue letter; send free text "
                             'with "kind": "text"') from None
        if not text:
            raise ValueError(f"input {position + 1} holds no residue")
    return ids, [row.count(unknown_id) for row in ids]


def embed(model, texts, kind="protein", batch_size=32):
    """Each text's embedding, unit length, and what reading it took.

    Returns (float32 array [len(texts), dim], [{"tokens", "windows", "unknown_tokens"}, ...]). A window's
    vector is the mean of its tokens ([CLS] and [SEP] included, as sentence-transformers pools), so an input
    that fits one window gets the model's own sentence embedding; windows are batched across inputs, shortest
    first, so little is padded.
    """
    import numpy
    import torch

    if kind not in KINDS:
        raise ValueError(f'kind must be one of {", ".join(KINDS)}, not {kind!r}')
    tokenizer, transformer = model.tokenizer, model[0].auto_model
    ids, unknown = token_ids(tokenizer, list(texts), kind)
    passes = [(number, [tokenizer.cls_token_id, *row[start:stop], tokenizer.sep_token_id])
              for number, row in enumerate(ids) for start, stop in windows(len(row))]
    passes.sort(key=lambda job: len(job[1]))
    dim = transformer.config.hidden_size
    sums = numpy.zeros((len(ids), dim), dtype=numpy.float64)
    weights = numpy.zeros(len(ids), dtype=numpy.float64)
    device = next(transformer.parameters()).device
    if batch_size < 1:  # range(0, n, -1) is empty: every answer would be the zero vector
        raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
    with torch.inference_mode():
        for at in range(0, len(passes), batch_size):
            batch = passes[at:at + batch_size]
            longest = max(len(tokens) for _, tokens in batch)
            input_ids = torch.full((len(batch), longest), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, (_, tokens) in enumerate(batch):
                input_ids[row, :len(tokens)] = torch.tensor(tokens)
                mask[row, :len(tokens)] = 1
            hidden = transformer(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            weight = mask.to(device).unsqueeze(-1).to(hidden.dtype)
            means = ((hidden * weight).sum(1) / weight.sum(1)).float().cpu().numpy()
            for (number, tokens), vector in zip(batch, means, strict=True):
                sums[number] += vector * len(tokens)
                weights[number] += len(tokens)
    vectors = sums / numpy.maximum(weights, 1.0)[:, None]
    vectors /= numpy.maximum(numpy.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    items = [{"tokens": len(row), "windows": len(windows(len(row))), "unknown_tokens": count}
             for row, count in zip(ids, unknown, strict=True)]
    return vectors.astype(numpy.float32), items


def main():
    socket_path, weights_root = sys.argv[1], sys.argv[2]
    worker_base = load_worker_base()
    started = time.monotonic()
    import numpy
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    staged = worker_base.staged()
    model = (staged if staged is not None else load(weights_root)).to(device)  # the to_device stage
    embed(model, ["MKV"])  # the first pass allocates; pay it before the first request
    load_s = time.monotonic() - started
    how = "staged in its zygote" if staged is not None else f"loaded from {weights_root}"
    print(f"minilm: {how}, on {device}, ready in {load_s:.1f} s", flush=True)

    def on_predict(payload):
        inputs = payload.get("inputs") if isinstance(payload, dict) else None
        if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
            raise ValueError('payload must be {"inputs": [str, ...]}')
        kind = payload.get("kind", "protein")
        if not inputs:
            return {"items": [], "dim": 384}
        vectors, items = embed(model, inputs, kind, batch_size=int(payload.get("batch_size", 32)))
        if payload.get("encoding") == "array":
            # One float32 [n, 384] array: it travels beside the line as an
            # attachment (a list of floats to a client that did not ask for arrays).
            return {"embeddings": numpy.ascontiguousarray(vectors), "items": items, "dim": int(vectors.shape[1]),
                    "pid": os.getpid(), "device": device}
        if payload.get("encoding") == "float32-base64":
            for item, vector in zip(items, vectors, strict=True):
                item["embedding_f32"] = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            return {"items": items, "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device}
        digits = int(payload.get("digits", 5))
        for item, vector in zip(items, vectors, strict=True):
            item["embedding"] = [round(float(x), digits) for x in vector]
        return {"items": items, "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device}

    def ready():
        return {"device": device, "load_s": round(load_s, 3), "window": WINDOW, "stride": STRIDE}

    worker_base.serve(slug="minilm", socket_path=socket_path, on_predict=on_predict, ready=ready)


if __name__ == "__main__":
    main()
