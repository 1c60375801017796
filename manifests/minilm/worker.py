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


_RESIDUE_TOKENS = {}  # id(tokenizer) -> (tokenizer, {letter: token id})


def residue_tokens(tokenizer):
    """Each residue letter's token id, either case, read from the vocabulary once per tokenizer: get_vocab() builds a
    dict of 30,522 words each time, which cost more than the model for a batch of 64 short single-sequence requests."""
    known = _RESIDUE_TOKENS.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        vocabulary = tokenizer.get_vocab()
        letters = {letter: vocabulary.get(letter.lower(), tokenizer.unk_token_id) for letter in map(chr, range(65, 91))}
        letters.update({letter.lower(): token for letter, token in letters.items()})
        known = _RESIDUE_TOKENS[id(tokenizer)] = (tokenizer, letters)
    return known[1]


def token_ids(tokenizer, texts, kind):
    """Each text's token ids (no [CLS] or [SEP]) and how many of them are [UNK]; ValueError names a bad input."""
    unknown_id = tokenizer.unk_token_id
    if kind == "text":
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        for position, found in enumerate(ids):
            if not found:
                raise ValueError(f"input {position + 1} holds no text")
        return ids, [row.count(unknown_id) for row in ids]
    letters = residue_tokens(tokenizer)
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


def read(tokenizer, payload):
    """A payload's inputs as token ids: (ids, unknown counts, its batch_size: windows per pass of the model);
    ValueError names what is wrong with it."""
    inputs = payload.get("inputs") if isinstance(payload, dict) else None
    if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
        raise ValueError('payload must be {"inputs": [str, ...]}')
    kind = payload.get("kind", "protein")
    if kind not in KINDS:
        raise ValueError(f'kind must be one of {", ".join(KINDS)}, not {kind!r}')
    size = payload.get("batch_size", 32)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"batch_size must be a whole number of at least 1, not {size!r}")
    ids, unknown = token_ids(tokenizer, inputs, kind) if inputs else ([], [])
    return ids, unknown, size


def work(payload):
    """The tokens the model reads for a payload, its windows overlapping (the pool's size_of: a model call is
    bounded by this, not only by its count of requests). A payload that cannot be read counts 0: the batch
    function says what is wrong with it."""
    inputs = payload.get("inputs") if isinstance(payload, dict) else None
    if not isinstance(inputs, list):
        return 0
    return sum(stop - start for text in inputs if isinstance(text, str) for start, stop in windows(len(text)))


def encode(model, rows, batch_size=32):
    """The embeddings of token id rows (float32 [len(rows), dim], unit length), however many requests they come
    from. A window's vector is the mean of its tokens ([CLS] and [SEP] included, as sentence-transformers pools),
    so a row that fits one window gets the model's own sentence embedding; a longer row is the mean of its
    windows, each weighted by its length. Windows are batched across rows, shortest first, so little is padded."""
    import numpy
    import torch

    tokenizer, transformer = model.tokenizer, model[0].auto_model
    passes = [(number, [tokenizer.cls_token_id, *row[start:stop], tokenizer.sep_token_id])
              for number, row in enumerate(rows) for start, stop in windows(len(row))]
    passes.sort(key=lambda job: len(job[1]))
    dim = transformer.config.hidden_size
    sums = numpy.zeros((len(rows), dim), dtype=numpy.float64)
    weights = numpy.zeros(len(rows), dtype=numpy.float64)
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
    return vectors.astype(numpy.float32)


def describe(ids, unknown):
    return [{"tokens": len(row), "windows": len(windows(len(row))), "unknown_tokens": count}
            for row, count in zip(ids, unknown, strict=True)]


def embed(model, texts, kind="protein", batch_size=32):
    """Each text's embedding, unit length, and what reading it took: (float32 array [len(texts), dim],
    [{"tokens", "windows", "unknown_tokens"}, ...]). ValueError names a bad input."""
    if kind not in KINDS:
        raise ValueError(f'kind must be one of {", ".join(KINDS)}, not {kind!r}')
    ids, unknown = token_ids(model.tokenizer, list(texts), kind)
    return encode(model, ids, batch_size), describe(ids, unknown)


def embed_batch(model, payloads):
    """One model call for several requests (the pool batches its callers' payloads): the inputs of every payload
    flattened into one list of rows, embedded together (their windows sorted by length across payloads, in passes
    of the smallest batch_size any payload asks for) and split back per payload. Returns, per payload in its order,
    (its vectors, its items), or the ValueError that says why that payload alone cannot be read: the others are
    answered all the same."""
    read_ok, outcomes = [], [None] * len(payloads)
    for position, payload in enumerate(payloads):
        try:
            read_ok.append((position, *read(model.tokenizer, payload)))
        except ValueError as exc:
            outcomes[position] = exc
    rows = [row for _, ids, _, _ in read_ok for row in ids]
    vectors = encode(model, rows, min(size for *_, size in read_ok)) if rows else None
    at = 0
    for position, ids, unknown, _ in read_ok:
        outcomes[position] = (vectors[at:at + len(ids)] if vectors is not None else None, describe(ids, unknown))
        at += len(ids)
    return outcomes


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

    def answer(payload, outcome):
        """A payload's result from its (vectors, items), in the encoding it asked for."""
        vectors, items = outcome
        if vectors is None or not items:
            return {"items": [], "dim": 384}
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

    def on_predict_batch(payloads):
        """Every payload's inputs in one model call, their windows sorted by length across payloads; a payload
        that cannot be read fails alone (its ValueError in its place), the others are answered."""
        results = []
        for payload, outcome in zip(payloads, embed_batch(model, payloads), strict=True):
            try:
                results.append(outcome if isinstance(outcome, Exception) else answer(payload, outcome))
            except (TypeError, ValueError) as exc:  # its own options ("digits") were wrong: it alone fails
                results.append(exc)
        return results

    def on_predict(payload):
        """One request per model call: a provider copy without [batching], or a worker run by hand."""
        (result,) = on_predict_batch([payload])
        if isinstance(result, Exception):
            raise result
        return result

    def ready():
        return {"device": device, "load_s": round(load_s, 3), "window": WINDOW, "stride": STRIDE}

    # With [batching] in its manifest the pool says how to batch (worker_base.BATCHING_ENV): the callers of this
    # replica share its model calls. Without it (a copy of the manifest, a worker run by hand) one request is
    # answered per call, as before.
    if os.environ.get(worker_base.BATCHING_ENV["max_batch_size"]):
        worker_base.serve(slug="minilm", socket_path=socket_path, on_predict_batch=on_predict_batch, size_of=work,
                          ready=ready)
    else:
        worker_base.serve(slug="minilm", socket_path=socket_path, on_predict=on_predict, ready=ready)


if __name__ == "__main__":
    main()
