"""The peer for evaluate.py: NVIDIA kvpress presses on the same windows and passkeys.

kvpress pins its own transformers, so this runs in a venv of its own:

    python -m venv /tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 kvpress==0.5.5 optimum-quanto==0.2.7
    /tmp/kvp/bin/python studies/peer_kvpress.py JOB.json RESULT.json  # what --peer kvpress runs

kvpress compresses the prompt's cache once, at the end of prefill (a forward
hook per attention layer); decoding then appends to the compressed
DynamicCache. As in evaluate.py the exact prefill runs once per batch: each
layer's hook inputs are recorded, and every press replays its own hook on a
fresh cache holding the recorded keys and values. The continuation is then
teacher-forced (text) or decoded greedily (passkey) over that cache. KV share =
bytes of the cache's tensors at the end / the same for the uncompressed cache.

With `quant_bits` in the job (evaluate.py --precision) it also runs HF
transformers' `QuantizedCache` with its quanto backend at those bits, alone and
under presses (kvpress compresses the dequantized cache and quantizes it again,
as its pipeline does). Its defaults stay: groups of 64; the prompt quantized
at prefill, new tokens in full precision until 128 have gathered; keys grouped
per token (`hf-quanto`) or per channel over 64 tokens as KIVI does
(`hf-quanto-kivi`). The model computes in float32 here, so
with `float_bits` every floating tensor (keys, values, scales, shifts) counts
at that many bits, as a 16-bit model would hold it; integer codes count as
stored.
"""
from __future__ import annotations

import json
import sys

import torch


def batches(items, most):
    n = -(-len(items) // most)
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def record(model, prompts):
    """Exact prefill; per layer the hook's (hidden_states, keys, values, kwargs),
    and the last token's logits."""
    from transformers import DynamicCache
    ids = torch.tensor(prompts)
    cache, recorded, hooks = DynamicCache(config=model.config), [], []

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        recorded.append((module, kwargs["hidden_states"], layer.keys, layer.values,
                         {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values")}))

    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        last = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in hooks:
            h.remove()
    return recorded, last


def tensor_bytes(t, float_bits=None) -> int:
    """Bytes of a tensor; a quanto tensor's are its parts' (codes, scales, shifts);
    with `float_bits`, a floating tensor counts at that many bits a number."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(t, name), float_bits) for name in t.__tensor_flatten__()[0])
    if float_bits and t.is_floating_point():
        return t.numel() * float_bits // 8
    return t.nbytes


def cache_bytes(cache, float_bits=None) -> int:
    fields = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(tensor_bytes(getattr(layer, f), float_bits) for layer in cache.layers
               for f in fields if getattr(layer, f, None) is not None)


def new_cache(model, quant):
    """A DynamicCache, or with quant = (bits, key axis) HF's quanto QuantizedCache."""
    from transformers import DynamicCache, QuantizedCache
    if quant is None:
        return DynamicCache(config=model.config)
    bits, axis_key = quant
    return QuantizedCache("quanto", model.config, nbits=bits, axis_key=axis_key, axis_value=0)


@torch.no_grad()
def replay(model, recorded, last, press, n, follow=None, quant=None, float_bits=None):
    """Compress a fresh cache (`quant`: see new_cache) with `press` (None: keep
    all), then take n - 1 steps: each feeds `follow`'s next token while it
    lasts, then the previous step's greedy choice. The logits of the prompt's
    last token and of every step (B, n, V), and the cache's bytes."""
    cache = new_cache(model, quant)
    for module, _, keys, values, _ in recorded:
        cache.update(keys, values, module.layer_idx)
    if press is not None:
        with press(model):  # sets up what the press needs (rotary_emb, ...), as in prefill
            for module, hidden, keys, values, kwargs in recorded:
                press.forward_hook(module, (), dict(kwargs, hidden_states=hidden,
                                                    past_key_values=cache), (None, None))
    T = recorded[0][1].shape[1]
    return steps(model, cache, last, T, n, follow), cache_bytes(cache, float_bits)


def steps(model, cache, last, T, n, follow=None):
    """`last` (B, V) and the logits of n - 1 steps on `cache`, which holds T
    positions: each feeds `follow`'s next token while it lasts, then the
    previous step's greedy choice. (B, n, V)."""
    out = [last]
    for i in range(n - 1):
        fed = follow is not None and i < follow.shape[1]
        token = follow[:, i:i + 1] if fed else out[-1].argmax(-1, keepdim=True)
        pos = torch.full((len(last), 1), T + i)
        out.append(model(token, past_key_values=cache, position_ids=pos).logits[:, -1].float())
    return torch.stack(out, dim=1)


# Presses that must run in their own prefill: KVzip scores each token by how
# much of it the model needs to repeat the context, a second pass through the
# model after prefill. They run one prompt at a time. kvpress 0.5.5's KVzip
# drops nothing: it hides the evicted keys from attention (a mask kept on each
# attention module, `masked_key_indices`), so its cache allocates every token.
LIVE = ("KVzipPress",)


@torch.no_grad()
def live(model, prompts, press, n, follow=None, float_bits=None):
    """replay for a press in LIVE: a prefill of each prompt with the press on,
    then the same steps."""
    from transformers import DynamicCache
    out, nbytes = [], 0
    for b, prompt in enumerate(prompts):
        cache = DynamicCache(config=model.config)
        with press(model):
            last = model(input_ids=torch.tensor([prompt]), past_key_values=cache,
                         logits_to_keep=1).logits[:, -1].float()
        out.append(steps(model, cache, last, len(prompt), n,
                         None if follow is None else follow[b:b + 1]))
        nbytes += cache_bytes(cache, float_bits)
    for layer in model.model.layers:  # KVzip's masks would outlive it (see LIVE)
        layer.self_attn.masked_key_indices = None
    return torch.cat(out), nbytes


def answer_cases(model, job, configs, run):
    """studies/longctx.py's tasks: per reading, per configuration, each case's
    greedy answer (token ids) and the bytes. `question_last` compresses the
    whole prompt; `agnostic` compresses the context, then feeds the question
    token by token. Cases batch only with cases of the same lengths (no padding)."""
    from tqdm import tqdm
    cases = job["longctx_cases"]  # [{"context", "question", "n"}]
    out = {rd: {name: dict(answers=[None] * len(cases), bytes=0, full_bytes=0)
                for _, name, _ in configs} for rd in job["readings"]}
    for rd in job["readings"]:
        groups = {}
        for i, c in enumerate(cases):
            shape = (len(c["context"]) + len(c["question"]), 0) if rd == "question_last" else (
                len(c["context"]), len(c["question"]))
            groups.setdefault(shape, []).append(i)
        for idx in tqdm([b for g in groups.values() for b in batches(g, job["batch"])],
                        desc=f"kvpress {rd} batches"):
            chunk = [cases[i] for i in idx]
            n = max(c["n"] for c in chunk)
            if rd == "question_last":
                prompts = [c["context"] + c["question"] for c in chunk]
                follow, first = None, 0
            else:
                prompts = [c["context"] for c in chunk]
                follow = torch.tensor([c["question"] for c in chunk])
                first = follow.shape[1]  # the answer starts after the last question token
            recorded, last = record(model, prompts)
            full = None
            for press, name, quant in configs:
                logits, nbytes = run(press, name, quant, rd, recorded, last, first + n, follow,
                                     prompts)
                if logits is None:
                    continue
                full = nbytes if name == "full (kvpress)" else full
                r = out[rd][name]
                for i, ids in zip(idx, logits[:, first:].argmax(-1).tolist()):
                    r["answers"][i] = ids
                r["bytes"] += nbytes
                r["full_bytes"] += full
            del recorded
    return out


def main(job_path, result_path):
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    job = json.loads(open(job_path).read())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32).eval()
    n_new = job.get("new_tokens", 0)
    float_bits = job.get("float_bits")
    # (press, name, quant): quant = (bits, key axis) of a QuantizedCache, None for none
    configs = [(None, "full (kvpress)", None)] + [
        (getattr(kvpress, name)(compression_ratio=r), f"kvpress:{name[:-5]} b={1 - r:g}", None)
        for name in job["presses"] if hasattr(kvpress, name) for r in job["ratios"]]
    for bits in job.get("quant_bits", []):
        configs += [(None, f"hf-quanto@{bits}", (bits, 0)),
                    (None, f"hf-quanto-kivi@{bits}", (bits, -1))]
        configs += [(getattr(kvpress, name)(compression_ratio=r),
                     f"kvpress:{name[:-5]}+hf-quanto@{bits} b={1 - r:g}", (bits, 0))
                    for name in job.get("quant_presses", []) if hasattr(kvpress, name)
                    for r in job["ratios"]]
    acc = {name: dict(kl=0.0, top1=0.0, nll=0.0, bytes=0, full=0, pk_bytes=0, pk_full=0)
           for _, name, _ in configs}
    # "name on task": why a configuration cannot run on those prompts (e.g. a press
    # whose window is longer than the prompt, a grouping that does not divide them)
    failed = {}

    def run(press, name, quant, task, recorded, last, n, follow=None, prompts=None):
        if f"{name} on {task}" in failed:
            return None, None
        try:
            if type(press).__name__ in LIVE:
                return live(model, prompts, press, n, follow, float_bits)
            return replay(model, recorded, last, press, n, follow, quant, float_bits)
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            failed[f"{name} on {task}"] = f"{type(e).__name__}: {e}"
            return None, None

    info = dict(kvpress=getattr(kvpress, "__version__", None) or _version("kvpress"),
                transformers=transformers.__version__, torch=torch.__version__,
                presses_missing=[p for p in job["presses"] if not hasattr(kvpress, p)],
                failed=failed)
    if "longctx_cases" in job:
        open(result_path, "w").write(json.dumps(dict(cases=answer_cases(model, job, configs, run),
                                                     info=info)))
        return
    from tqdm import tqdm
    for chunk in tqdm(batches(job["windows"], job["batch"]), desc="kvpress text batches"):
        follow = torch.tensor([w[-n_new:] for w in chunk])
        recorded, last = record(model, [w[:-n_new] for w in chunk])
        ref = None
        for press, name, quant in tqdm(configs, desc="kvpress configurations", leave=False):
            logits, nbytes = run(press, name, quant, "text", recorded, last, n_new, follow)
            if logits is None:
                continue
            logp = logits.log_softmax(-1)
            ref, full = (logp, nbytes) if ref is None else (ref, full)
            a = acc[name]
            a["kl"] += torch.nn.functional.kl_div(logp, ref, log_target=True,
                                                  reduction="none").sum().item()
            a["top1"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            a["nll"] -= logp.gather(-1, follow[..., None]).sum().item()
            a["bytes"], a["full"] = a["bytes"] + nbytes, a["full"] + full
        del recorded
    # Passkey prompts of one length batch without padding; group them by length.
    by_len = {}
    for i, (ids, _) in enumerate(job["cases"]):
        by_len.setdefault(len(ids), []).append(i)
    answers = {name: [None] * len(job["cases"]) for _, name, _ in configs}
    for idx in by_len.values():
        for chunk in tqdm(batches(idx, job["batch"]), desc="kvpress passkey batches"):
            recorded, last = record(model, [job["cases"][i][0] for i in chunk])
            for press, name, quant in configs:
                logits, nbytes = run(press, name, quant, "passkeys", recorded, last,
                                    job["passkey_tokens"])
                if logits is None:
                    continue
                full = nbytes if name == "full (kvpress)" else full
                for i, ids in zip(chunk, logits.argmax(-1).tolist()):
                    answers[name][i] = ids
                acc[name]["pk_bytes"] += nbytes
                acc[name]["pk_full"] += full
            del recorded
    count = len(job["windows"]) * n_new
    rows = {}
    for name, a in acc.items():
        if f"{name} on text" in failed:
            continue
        pk = f"{name} on passkeys" not in failed and bool(job["cases"])
        rows[name] = dict(kl=a["kl"] / count, top1=a["top1"] / count,
                          ppl=float(torch.tensor(a["nll"] / count).exp()),
                          share=a["bytes"] / a["full"],
                          pk_share=a["pk_bytes"] / a["pk_full"] if pk else None,
                          pk_tokens=answers[name] if pk else None)
    open(result_path, "w").write(json.dumps(dict(rows=rows, info=info)))


def _version(package):
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    except Exception:  # noqa: BLE001 - evaluate.py writes why into its report
        import traceback
        open(sys.argv[2], "w").write(json.dumps({"error": traceback.format_exc()}))
