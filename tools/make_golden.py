#!/usr/bin/env python3
"""Extra golden cases for the Gated DeltaProduct operator, from an independent float64
reference: the token-by-token recurrence written with jax.lax.scan and differentiated
by jax.grad (nothing shared with the C oracle but the definition in docs/design.md s.2).

Writes spec/fixtures/golden/gdp_x_*.safetensors in the format of the shipped cases
(spec/fixtures/golden/README.md): float64 tensors, int64 cu_seqlens, metadata strings.
core/tests/test_gdp_cpu.c runs every gdp_*.safetensors it finds there.

    pip install "jax[cpu]"        # any recent version; float64 is switched on below
    python3 tools/make_golden.py  # deterministic: fixed seeds, rewrites the files

Each file stays under 2 MB so that the fixtures remain commit-sized.
"""
import json
import os
import struct
import sys

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

EPS_L2 = 1e-6
OUT_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "fixtures", "golden"))
MAX_BYTES = 2 * 1024 * 1024


def l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + EPS_L2)


def run_sequence(q, k, v, g, beta, h0, n, scale):
    """One sequence, all heads.  q [L,H,K], k [L*n,H,K], v [L*n,H,V], g [L,H] or None,
    beta [L*n,H], h0 [H,K,V].  Returns o [L,H,V], ht [H,K,V]."""
    L, H, K = q.shape
    V = v.shape[-1]
    if L == 0:
        return jnp.zeros((0, H, V)), h0
    ks = k.reshape(L, n, H, K)
    vs = v.reshape(L, n, H, V)
    bs = beta.reshape(L, n, H)
    gs = g if g is not None else jnp.zeros((L, H))

    def token(S, xs):
        qt, kt, vt, bt, gt = xs
        S = S * jnp.exp(gt)[:, None, None]
        for j in range(n):
            u = jnp.einsum("hkv,hk->hv", S, kt[j])
            S = S + jnp.einsum("hk,hv->hkv", kt[j], bt[j][:, None] * (vt[j] - u))
        return S, scale * jnp.einsum("hkv,hk->hv", S, qt)

    ht, o = jax.lax.scan(token, h0, (q, ks, vs, bs, gs))
    return o, ht


def forward(inputs, cu, B, T, n, scale, use_l2):
    """The operator over a batch [B,T,...] or a packed batch (B = 1, cu_seqlens)."""
    q, k, v, g, beta, h0 = (inputs[x] for x in ("q", "k", "v", "g", "beta", "h0"))
    if use_l2:
        q, k = l2norm(q), l2norm(k)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if cu is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        spans = [(0, int(cu[s]), int(cu[s + 1])) for s in range(len(cu) - 1)]
    outs, finals = [], []
    for s, (b, lo, hi) in enumerate(spans):
        init = h0[s] if h0 is not None else jnp.zeros((H, K, V))
        o, ht = run_sequence(q[b, lo:hi], k[b, lo * n:hi * n], v[b, lo * n:hi * n],
                             None if g is None else g[b, lo:hi], beta[b, lo * n:hi * n],
                             init, n, scale)
        outs.append((b, o))
        finals.append(ht)
    if cu is None:
        o = jnp.stack([o for _, o in outs])
    else:
        o = jnp.concatenate([o for _, o in outs], axis=0)[None]
    return o, jnp.stack(finals)


def make_case(name, seed, B, T, H, K, V, n, gated, use_l2, beta_max, with_h0, cu=None,
              g_range=(0.85, 0.999)):
    rng = np.random.default_rng(seed)
    if cu is not None:
        assert B == 1 and cu[0] == 0 and cu[-1] == T
    N = B if cu is None else len(cu) - 1
    scale = K ** -0.5
    x = {
        "q": rng.standard_normal((B, T, H, K)),
        "k": rng.standard_normal((B, T * n, H, K)),
        "v": rng.standard_normal((B, T * n, H, V)),
        # beta = beta_max * sigmoid(b), as the mixer makes it
        "beta": beta_max / (1.0 + np.exp(-rng.standard_normal((B, T * n, H)))),
        "g": np.log(rng.uniform(*g_range, size=(B, T, H))) if gated else None,
        "h0": 0.5 * rng.standard_normal((N, H, K, V)) if with_h0 else None,
    }
    if not use_l2:  # the op will not normalise: hand it unit-norm q and k
        for key in ("q", "k"):
            x[key] = x[key] / np.linalg.norm(x[key], axis=-1, keepdims=True)
    d_o = rng.standard_normal((B, T, H, V))
    dht = rng.standard_normal((N, H, K, V))

    diff = {key: jnp.asarray(val) for key, val in x.items() if val is not None}
    const = {key: None for key, val in x.items() if val is None}

    def loss(d):
        o, ht = forward({**d, **const}, cu, B, T, n, scale, use_l2)
        return jnp.sum(o * d_o) + jnp.sum(ht * dht), (o, ht)

    grads, (o, ht) = jax.grad(loss, has_aux=True)(diff)
    tensors = {key: np.asarray(val) for key, val in diff.items()}
    tensors.update({"o": np.asarray(o), "ht": np.asarray(ht), "do": d_o, "dht": dht})
    tensors.update({"d" + key: np.asarray(val) for key, val in grads.items()})
    if cu is not None:
        tensors["cu_seqlens"] = np.asarray(cu, dtype=np.int64)
    meta = {
        "reference": "float64 token-by-token recurrence, jax.lax.scan + jax.grad (tools/make_golden.py)",
        "num_householder": str(n),
        "scale": repr(scale),
        "use_qk_l2norm": "true" if use_l2 else "false",
        "gated": "true" if gated else "false",
        "beta_range": "0,%g" % beta_max,
        "layout": "q[B,T,H,K] k[B,T*n,H,K] v[B,T*n,H,V] beta[B,T*n,H] g[B,T,H] h0/ht[N,H,K,V]; "
                  "row t*n+j is householder step j of token t",
        "loss": "sum(o*do)+sum(ht*dht)",
        "seed": str(seed),
    }
    path = os.path.join(OUT_DIR, name + ".safetensors")
    size = write_safetensors(path, tensors, meta)
    print("%s: %d bytes" % (path, size))
    if size > MAX_BYTES:
        sys.exit("%s is %d bytes, over the %d-byte budget: shrink the case" % (path, size, MAX_BYTES))


def write_safetensors(path, tensors, meta):
    header, blobs, offset = {"__metadata__": meta}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.float64): "F64", np.dtype(np.int64): "I64"}[arr.dtype]
        blob = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return 8 + len(text) + offset


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    only = set(sys.argv[1:])  # case names to (re)write; none: all of them
    global make_case
    if only:
        all_cases = make_case

        def make_case(name, *args, **kw):
            if name in only:
                all_cases(name, *args, **kw)
    # Ungated DeltaProduct, negative eigenvalues, unit-norm keys given (use_qk_l2norm false).
    make_case("gdp_x_n2_ungated_unitk", 101, B=2, T=57, H=2, K=32, V=48, n=2, gated=False,
              use_l2=False, beta_max=2.0, with_h0=True)
    # n = 4, packed, empty sequences at the start, inside and at the end.
    make_case("gdp_x_n4_packed_empty", 102, B=1, T=97, H=2, K=32, V=24, n=4, gated=True,
              use_l2=True, beta_max=2.0, with_h0=True, cu=[0, 0, 23, 23, 60, 97, 97])
    # K = V = 128 over an odd length that spans several chunks of the expanded stream.
    make_case("gdp_x_n2_k128", 103, B=1, T=133, H=1, K=128, V=128, n=2, gated=True,
              use_l2=True, beta_max=1.0, with_h0=False)
    # Long: a thousand tokens with slow decay, so early tokens still matter at the end.
    make_case("gdp_x_n2_long", 104, B=1, T=1001, H=1, K=16, V=16, n=2, gated=True,
              use_l2=True, beta_max=1.0, with_h0=True, g_range=(0.99, 0.9999))
    # n = 3 at K = V = 128, packed with an empty sequence: the shape where the bf16 chunked
    # CUDA kernels' dg sits closest to 1e-2 (docs/kernels.md section 3.6).  (A K = V = 64 case of
    # 300 slowly decaying tokens was tried and left out: its dg is 1.6e-2 from the float64
    # reference already when the float64 recurrence runs on the bf16-rounded inputs, so no
    # bf16 implementation can meet the 1e-2 bar on it.)
    make_case("gdp_x_n3_k128_packed", 106, B=1, T=64, H=1, K=128, V=128, n=3, gated=True,
              use_l2=True, beta_max=1.0, with_h0=False, cu=[0, 17, 17, 64])


if __name__ == "__main__":
    main()
