"""The quality study's simulation: each attention layer's K/V through a real QuantizedKVCache round
trip, attended as a token-by-token decode over that cache would attend them.

:class:`Sim` is a transformers attention function (``install_sim`` registers it as
:data:`SIM_NAME` and sets it on a model): for the active configuration (``Sim.cfg``, see
:mod:`.configs`; None: full precision) each layer quantizes its keys and values through
:class:`~flash_attn_tq.cache.QuantizedKVCache` (quantize, pack, unpack, dequantize: the cache's own
round trip, key transform and calibration included) and query ``i`` sees key ``j <= i`` in 16-bit
when ``i - j < fp16_window`` or ``j < sink_tokens``, else its dequantized value. Configurations
that no kernel implements (transform coding, QJL sketches, the research key transforms of
:class:`KeyValueTransform`) are simulated here only.

Shapes are transformers': queries ``[B, Hq, S, D]``, keys and values ``[B, Hkv, S, D]``; the
cache's own layout is ``[B, S, H, D]``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..cache import QuantizedKVCache
from .quality import RESEARCH_TRANSFORMS, head_bits_of, key_bits_of, protected_layers, v2_layers

SIM_NAME = "tq_sim"  # the attention implementation's name install_sim registers


def reflect(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x - 2 (x . w) w: the Householder reflection by unit w (its own inverse)."""
    return torch.addcmul(x, (x * w).sum(-1, keepdim=True), w, value=-2.0)


def main_direction_householder(x: torch.Tensor) -> torch.Tensor:
    """Householder vectors w [B, H, d] with (I - 2 w w^T) u = +-e_0 for the main direction u of x [B, n, H, d]."""
    cov = torch.einsum("bnhi,bnhj->bhij", x, x) / x.shape[1]
    vec = torch.linalg.eigh(cov.double())[1][..., -1].float()
    vec = torch.where(vec[..., :1] > 0, -vec, vec)  # u[0] <= 0, so |u - e_0| >= 1
    w = vec.clone()
    w[..., 0] -= 1.0
    return w / w.norm(dim=-1, keepdim=True)


class KeyValueTransform:
    """Transforms only the simulation has (no default uses them and no kernel fuses them), fitted on
    a prompt's first tokens ``k, v [B, n, H, d]`` (queries ``q [B, n, Hq, d]`` for key_scale_q) and
    exact for attention: keys ``(k - mu) / s`` (mu: the mean key with key_center, s: per-channel
    ``rms(k - mu) ** key_scale``, or ``(rms_k / rms_q) ** key_scale`` with key_scale_q, queries
    multiplied by s), then reflected so their main direction is e_0 (key_pca; with fit="mean" the
    offset stores it exactly); values reflected likewise (value_pca). The attention of q over the
    transformed keys differs from the original only by the shift q . mu shared by every key."""

    def __init__(self, cfg: Mapping[str, Any], k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None):
        kf, B, H, D = k.float(), k.shape[0], k.shape[2], k.shape[3]
        self.shift = kf.mean(1) if cfg["key_center"] else kf.new_zeros(B, H, D)
        self.div = kf.new_ones(B, H, D)
        if cfg["key_scale"] > 0:
            rms = (kf - self.shift[:, None]).pow(2).mean(1).sqrt()
            rms = rms.clamp(min=1e-3 * float(rms.max().clamp(min=1e-30)))
            if cfg["key_scale_q"] and q is not None:  # balance against the queries: s = (rms_k / rms_q) ** a
                rq = q.float().reshape(q.shape[0], q.shape[1], H, -1, D).pow(2).mean((1, 3)).sqrt()
                rms = rms / rq.clamp(min=1e-3 * float(rq.max().clamp(min=1e-30)))
            div = rms.pow(cfg["key_scale"])
            self.div = div / div.pow(2).mean(-1, keepdim=True).sqrt()  # unit mean square: only the shape matters
        self.house = (
            main_direction_householder((kf - self.shift[:, None]) / self.div[:, None]) if cfg["key_pca"] else None
        )
        self.vhouse = main_direction_householder(v.float()) if cfg["value_pca"] else None

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        kt = (k.float() - self.shift[:, None]) / self.div[:, None]
        return kt if self.house is None else reflect(kt, self.house[:, None])

    def keys_back(self, kt: torch.Tensor) -> torch.Tensor:
        x = kt.float() if self.house is None else reflect(kt.float(), self.house[:, None])
        return x * self.div[:, None] + self.shift[:, None]

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """value_pca's reflection (its own inverse: it also maps stored values back)."""
        return v.float() if self.vhouse is None else reflect(v.float(), self.vhouse[:, None])


class Sim:
    """The attention function that quantizes each layer's K/V through QuantizedKVCache.

    Its state is the class's (one simulation a process): the active (resolved) configuration
    ``cfg``, the prompt tokens the key transforms are calibrated on (``calib``), the model's layer
    count and RoPE frequencies (set by :func:`install_sim`)."""

    cfg = None  # the active config dict (None: full precision)
    calib = 256  # prompt tokens the key transform is calibrated on
    num_layers = 0
    # rows before this index attend in full precision: the prompt's prefill as TQCache(prefill="full")
    # runs it (model.generate on a long prompt); later rows decode over the cache. 0: every row decodes
    prefill_len = 0

    @staticmethod
    def keep_center_pairs(cache: QuantizedKVCache, pairs: int) -> None:
        """The calibrated RoPE center ``cache.k_center [B, H, D]`` on its ``pairs`` strongest rotate-half
        pairs ``(m, m + D/2)`` of each (row, head), zero on the others."""
        c = cache.k_center
        half = c.shape[-1] // 2
        energy = c[..., :half] ** 2 + c[..., half:] ** 2
        keep = torch.zeros_like(energy).scatter_(-1, energy.topk(pairs, dim=-1).indices, 1.0)
        cache.keys.center = c * torch.cat([keep, keep], -1)

    @staticmethod
    def roundtrip(
        key: torch.Tensor, value: torch.Tensor, cfg: Mapping[str, Any], calib: int, query: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """key/value [B, Hkv, S, D] -> (k_hat, v_hat, k_16, v_16), float32 [B, Hkv, S, D]: the dequantized
        values (original domain) and the 16-bit values the window/sinks hold (window keys are stored
        transformed, so their float16 rounding is the transformed key's)."""
        B, H, S, D = key.shape
        s0 = min(cfg["sink_tokens"], S)
        k = key.transpose(1, 2)[:, s0:].float()
        v = value.transpose(1, 2)[:, s0:].float()
        kh, vh = key.float().clone(), value.float().clone()
        k16, v16 = key.half().float(), value.half().float()
        if S - s0 == 0:
            return kh, vh, k16, v16
        opts = {n: cfg[n] for n in ("quantizer", "k_bits", "v_bits", "fit", "key_center", "scale_only")}
        if opts["quantizer"] == "asym":
            opts.pop("fit")
        research = any(cfg.get(n) for n in RESEARCH_TRANSFORMS)
        if research:  # the simulation's own transforms (KeyValueTransform) center the keys too
            opts["key_center"] = False
        if cfg.get("rope_center") == "exact":  # QuantizedKVCache(key_center="rope"), positions after the sinks
            opts.update(key_center="rope", rope_inv_freq=Sim.inv_freq, rope_position_offset=s0)
        cache = QuantizedKVCache(B, S - s0, H, D, dtype=torch.float16, device=key.device, **opts)
        c = max(calib - s0, 1)
        if cache.rope_center:
            cache.calibrate(k[:, :c], positions=torch.arange(c, device=k.device).expand(B, -1))
        shift = None
        if cfg.get("rope_center") == "tile":  # (simulation only) the shift is exact once each score gets q . shift_j
            shift = Sim.rope_shift(k, s0, c)
            k = k - shift
        v_mean = None
        if cfg.get("value_center"):  # exact too: the quantized part's normalised output plus the mean
            v_mean = v[:, :c].mean(1, keepdim=True)
            v = v - v_mean
        tf = None
        if research:  # the prompt's statistics, then fixed
            q = None if query is None else query.transpose(1, 2)[:, s0 : s0 + c]
            tf = KeyValueTransform(cfg, k[:, :c], v[:, :c], q)
            k16[:, :, s0:] = tf.keys_back(tf.keys(k).half()).transpose(1, 2)
            v16[:, :, s0:] = tf.values(tf.values(v).half()).transpose(1, 2)
            k, v = tf.keys(k), tf.values(v)
        elif cache.key_center:
            cache.calibrate(k[:, :c], positions=torch.arange(c, device=k.device).expand(B, -1))
            if cfg.get("rope_center_pairs"):
                Sim.keep_center_pairs(cache, cfg["rope_center_pairs"])
            pos = torch.arange(S - s0, device=k.device).expand(B, -1)
            k16[:, :, s0:] = cache.untransform_keys(
                cache.transform_keys(k, positions=pos).half(), positions=pos
            ).transpose(1, 2)
        cache.append(k, v)
        kd, vd = cache.dequantize(use_window=False)
        if cfg.get("mean_error"):
            kd, vd = Sim.mean_error_offset(cache, k, kd, v, vd)
        if tf is not None:  # back from the transformed domain the cache held
            kd, vd = tf.keys_back(kd), tf.values(vd)
        kh[:, :, s0:] = (kd if shift is None else kd + shift).transpose(1, 2)
        vh[:, :, s0:] = (vd if v_mean is None else vd + v_mean).transpose(1, 2)
        Sim.sketch = None
        if cfg.get("qjl"):  # residual sign sketch: signs of S r and |r| (float16) per quantized key
            r = key.float() - kh
            r[:, :, :s0] = 0
            proj = Sim.projection(D).to(r.device)
            Sim.sketch = (torch.sign(r @ proj.T), r.norm(dim=-1).half().float())
        return kh, vh, k16, v16

    @staticmethod
    def mean_error_offset(
        cache: QuantizedKVCache, k: torch.Tensor, kd: torch.Tensor, v: torch.Tensor, vd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized ``kd, vd [B, n, H, D]`` with each vector's mean error over its rotated
        coordinates added to its offset (rounded to float16): the error along the rotated all-ones
        direction removed. A key transform (centering) shifts a key and its reconstruction alike, so
        the error is the same in the domain the cache coded."""
        out = []
        for x, xd, qz in ((k, kd, cache.k_quantizer), (v, vd, cache.v_quantizer)):
            xdr = qz.rotate(xd.float())
            m = (qz.rotate(x.float()) - xdr).mean(-1, keepdim=True).half().float()
            out.append(qz.unrotate(xdr + m))
        return out[0], out[1]

    inv_freq = None  # the model's RoPE frequencies (rotate-half convention), for rope_center

    @staticmethod
    def rope_shift(k: torch.Tensor, s0: int, n_cal: int, tile: int = 32, max_drift: float = 0.1) -> torch.Tensor:
        """A tile-wise RoPE-aware key center [B, N, H, D] for post-RoPE keys k [B, N, H, D] at
        positions s0..s0+N-1 (what a kernel adding one bias a tile and query could use): R(p_t) c, c
        the mean pre-RoPE key R(-p) k_p of the first n_cal tokens, at the tile's middle position p_t
        for the pairs that turn by less than max_drift radians over half a tile; the prompt's post-RoPE
        mean for the others. (rope_center="exact", R(p_j) c for every key, is QuantizedKVCache's
        key_center="rope".)"""
        from ..cache import rope_turn

        B, N, H, D = k.shape
        inv = Sim.inv_freq.to(k.device).float()
        pos = torch.arange(s0, s0 + N, device=k.device).float()
        n = min(n_cal, N)
        c = rope_turn(k[:, :n], pos[:n], inv, inverse=True).mean(1, keepdim=True).expand(B, N, H, D)
        slow = torch.cat([inv, inv]) * tile / 2 < max_drift
        pt = torch.div(pos, tile, rounding_mode="floor") * tile + tile / 2
        return torch.where(slow, rope_turn(c, pt, inv), k[:, :n].mean(1, keepdim=True))

    # uniform quantizers for a unit Gaussian: step and mean squared error by bit width (Max 1960)
    STEP = torch.tensor([0.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0568, 0.0307])
    MSE = torch.tensor([1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.00349, 0.00104, 0.000302, 0.0000869, 0.0])

    @staticmethod
    def allocate_bits(weight: torch.Tensor, total: int, max_bits: int = 8) -> torch.Tensor:
        """Greedy reverse water-filling: weight [..., D] (variance x importance a coordinate), total
        bits a vector -> bits [..., D] (long). Each step gives a bit where it removes the most error."""
        bits = torch.zeros(weight.shape, dtype=torch.long)
        one = torch.ones(*weight.shape[:-1], 1, dtype=torch.long)
        for _ in range(int(total)):
            gain = weight * (Sim.MSE[bits] - Sim.MSE[bits + 1])
            gain = gain.masked_fill(bits >= max_bits, -1.0)
            bits.scatter_add_(-1, gain.argmax(-1, keepdim=True), one)
        return bits

    @staticmethod
    def gaussian_grid(z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """z (unit-variance units) -> the nearest level of the b-bit uniform Gaussian grid (b: same shape;
        0 bits: 0)."""
        step = Sim.STEP[b]
        half = (1 << b).float() / 2
        level = torch.minimum(torch.maximum(torch.floor(z / step.clamp(min=1e-9)), -half), half - 1)
        return torch.where(b > 0, (level + 0.5) * step, torch.zeros_like(z))

    @staticmethod
    def transform_code(
        x: torch.Tensor, c: int, avg_bits: float, importance: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, H, S, D] float32 -> its transform-coded reconstruction (see the klt configs)."""
        B, H, S, D = x.shape
        mu = x[:, :, :c].mean(2, keepdim=True)
        xc = x - mu
        cov = xc[:, :, :c].transpose(-1, -2) @ xc[:, :, :c] / c
        lam, U = torch.linalg.eigh(cov)  # ascending
        lam = lam.clamp(min=1e-12)
        imp = torch.ones_like(lam) if importance is None else torch.einsum("bhdi,bhde,bhei->bhi", U, importance, U)
        weight = lam * imp.clamp(min=1e-12)
        order = weight.argsort(-1, descending=True)
        U = U.gather(-1, order[:, :, None, :].expand(-1, -1, D, -1))
        lam, weight = lam.gather(-1, order), weight.gather(-1, order)
        bits = Sim.allocate_bits(weight, round(avg_bits * D))
        y = xc @ U  # KLT coordinates, most important first
        sigma = lam.sqrt()[:, :, None]
        gain = (y.norm(dim=-1, keepdim=True) / lam.sum(-1).sqrt()[:, :, None, None]).half().float().clamp(min=1e-8)
        z = y / (gain * sigma)
        zq = Sim.gaussian_grid(z, bits[:, :, None, :].expand_as(z))
        return (zq * gain * sigma) @ U.transpose(-1, -2) + mu

    @staticmethod
    def _hadamard(n: int) -> torch.Tensor:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(n)

    @staticmethod
    def pair_code(
        x: torch.Tensor,
        c: int,
        avg_bits: float,
        q_energy: torch.Tensor | None = None,
        group: int = 16,
        min_bits: int = 1,
    ) -> torch.Tensor:
        """RoPE-aware allocation (no calibrated rotation: RoPE moves keys through each frequency pair's
        plane, so only pair energies are stable across positions). x [B, H, S, D] float32; pairs
        (i, i + D/2) (rotate_half layout). Pairs sorted by energy x query energy go into groups of
        `group` dims; each group gets one bit width (water-filling on the groups' mean log weight), a
        Hadamard transform inside the group after per-dim normalisation, a uniform Gaussian grid, one
        float16 gain a token."""
        B, H, S, D = x.shape
        P = D // 2
        mu = x[:, :, :c].mean(2, keepdim=True)
        xc = x - mu
        e = xc[:, :, :c].pow(2).mean(2)  # [B, H, D]
        e_pair = (e[..., :P] + e[..., P:]).clamp(min=1e-12) / 2  # per dim of the pair
        w_pair = e_pair * (1.0 if q_energy is None else (q_energy[..., :P] + q_energy[..., P:]).clamp(min=1e-12))
        order = w_pair.argsort(-1, descending=True)  # [B, H, P]
        per = group // 2  # groups hold whole pairs
        dims = torch.stack([order.view(B, H, P // per, per), (order + P).view(B, H, P // per, per)], -1)
        dims = dims.reshape(B, H, D)  # group g: dims [g*group, (g+1)*group)
        ng = D // group
        w_sorted = w_pair.gather(-1, order).view(B, H, ng, per)
        w_group = w_sorted.log().mean(-1).exp()  # geometric mean
        bits_g = Sim.allocate_bits(w_group, round(avg_bits * ng) - min_bits * ng, max_bits=8 - min_bits) + min_bits
        sigma = e_pair.repeat(1, 1, 2).sqrt()  # [B, H, D]
        z = (xc / sigma[:, :, None]).gather(-1, dims[:, :, None, :].expand(-1, -1, S, -1))
        Hm = Sim._hadamard(group)
        zg = z.view(B, H, S, ng, group) @ Hm
        gain = (zg.norm(dim=(-1, -2)) / math.sqrt(D)).half().float().clamp(min=1e-8)[..., None, None]
        u = zg / gain
        uq = Sim.gaussian_grid(u, bits_g[:, :, None, :, None].expand_as(u))
        zq = ((uq * gain) @ Hm.T).reshape(B, H, S, D)
        out = torch.empty_like(zq).scatter_(-1, dims[:, :, None, :].expand(-1, -1, S, -1), zq)
        return out * sigma[:, :, None] + mu

    @staticmethod
    def roundtrip_klt(
        key: torch.Tensor, value: torch.Tensor, cfg: Mapping[str, Any], calib: int, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, H, S, D = key.shape
        s0 = min(cfg["sink_tokens"], S)
        kh, vh = key.float().clone(), value.float().clone()
        if S - s0 < 2:
            return kh, vh, key.half().float(), value.half().float()
        c = max(min(calib - s0, S - s0), 2)
        opt = cfg["klt"]
        imp = None
        if query is not None:
            G = query.shape[1] // H
            qc = query.float()[:, :, s0 : s0 + c].reshape(B, H, G * c, D)  # a kv head's G query heads
            imp = qc.transpose(-1, -2) @ qc / qc.shape[2]
        if opt.get("mode") == "pairs":
            qe = None if imp is None else torch.diagonal(imp, dim1=-2, dim2=-1)
            g, mb = opt.get("group", 16), opt.get("min_bits", 1)
            kh[:, :, s0:] = Sim.pair_code(key.float()[:, :, s0:], c, opt["kb"], qe, g, mb)
            vh[:, :, s0:] = Sim.pair_code(value.float()[:, :, s0:], c, opt["vb"], None, g, mb)
        else:
            kh[:, :, s0:] = Sim.transform_code(key.float()[:, :, s0:], c, opt["kb"], imp)
            vh[:, :, s0:] = Sim.transform_code(value.float()[:, :, s0:], c, opt["vb"])
        return kh, vh, key.half().float(), value.half().float()

    sketch = None  # (signs [B, Hkv, S, D], norms [B, Hkv, S]) of the current layer's QJL keys
    _projections: dict = {}

    @staticmethod
    def projection(d: int) -> torch.Tensor:
        """A fixed Gaussian QJL projection [d, d] (the same in every layer: the keys' rotation differs)."""
        if d not in Sim._projections:
            Sim._projections[d] = torch.randn(d, d, generator=torch.Generator().manual_seed(1234))
        return Sim._projections[d]

    @staticmethod
    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cfg = Sim.cfg
        B, Hq, S, D = query.shape
        G = Hq // key.shape[1]
        scaling = scaling or D**-0.5
        if cfg is None or module.layer_idx in protected_layers(cfg, Sim.num_layers):
            out = F.scaled_dot_product_attention(
                query, key.repeat_interleave(G, 1), value.repeat_interleave(G, 1), is_causal=True, scale=scaling
            )
            return out.transpose(1, 2).contiguous(), None
        if key_bits_of(cfg, module.layer_idx, Sim.num_layers) != cfg["k_bits"]:
            cfg = dict(cfg, k_bits=key_bits_of(cfg, module.layer_idx, Sim.num_layers))
        if module.layer_idx in v2_layers(cfg, Sim.num_layers):
            cfg = dict(cfg, v_bits=2)
        if cfg.get("klt"):
            Sim.sketch = None
            kh, vh, kf, vf = Sim.roundtrip_klt(key, value, cfg, Sim.calib, query)
        else:
            kh, vh, kf, vf = Sim.roundtrip(key, value, cfg, Sim.calib, query)
            heads = head_bits_of(cfg, module.layer_idx)  # per-head widths (k_hcal)
            for w in set(heads.values()):
                kw, vw = Sim.roundtrip(key, value, dict(cfg, k_bits=w[0], v_bits=w[1]), Sim.calib, query)[:2]
                for h in (h for h, x in heads.items() if x == w):
                    kh[:, h], vh[:, h] = kw[:, h], vw[:, h]
        kf, vf, kh, vh = (t.repeat_interleave(G, 1) for t in (kf, vf, kh, vh))
        sketch = None
        if Sim.sketch is not None:  # q . r ~ sqrt(pi / 2) / m * |r| * (S q) . sign(S r)
            signs, norms = (t.repeat_interleave(G, 1) for t in Sim.sketch)
            sq = query.float() @ Sim.projection(D).to(query.device).T
            sketch = (signs, norms * math.sqrt(math.pi / 2) / D, sq)
        recent = cfg.get("recent_window", 0)  # keys R <= age < R + recent at recent_bits (age-based precision)
        if recent:
            rk, rv = cfg["recent_bits"]
            band_cfg = dict(cfg, k_bits=rk, v_bits=rv)
            if cfg.get("recent_raw"):  # (its keys coded as they came)
                band_cfg.update(rope_center=None, key_center=False)
            kr, vr, _, _ = Sim.roundtrip(key, value, band_cfg, Sim.calib, query)
            kr, vr = kr.repeat_interleave(G, 1), vr.repeat_interleave(G, 1)
        q = query.float()
        R, s0 = cfg["fp16_window"], cfg["sink_tokens"]
        out = torch.empty(B, Hq, S, D, device=query.device)
        pos = torch.arange(S, device=query.device)
        for i0 in range(0, S, 512):
            i1 = min(S, i0 + 512)
            qi = q[:, :, i0:i1]
            ii, jj = pos[i0:i1, None], pos[None, :i1]
            full = ((ii - jj) < R) | (jj < s0) | (ii < Sim.prefill_len)
            s_quant = qi @ kh[:, :, :i1].transpose(-1, -2)
            if sketch is not None:
                signs, norms, sq = sketch
                s_quant = s_quant + (sq[:, :, i0:i1] @ signs[:, :, :i1].transpose(-1, -2)) * norms[:, :, None, :i1]
            if recent:
                band = ~full & ((ii - jj) < R + recent)
                s_quant = torch.where(band, qi @ kr[:, :, :i1].transpose(-1, -2), s_quant)
            s = torch.where(full, qi @ kf[:, :, :i1].transpose(-1, -2), s_quant) * scaling
            p = torch.softmax(s.masked_fill(jj > ii, -math.inf), -1)
            pf = p * full
            if recent:
                pr = p * band
                out[:, :, i0:i1] = pf @ vf[:, :, :i1] + pr @ vr[:, :, :i1] + (p - pf - pr) @ vh[:, :, :i1]
            else:
                out[:, :, i0:i1] = pf @ vf[:, :, :i1] + (p - pf) @ vh[:, :, :i1]
        return out.transpose(1, 2).contiguous().to(query.dtype), None


def install_sim(model: Any) -> None:
    """Register :meth:`Sim.attention` with transformers as :data:`SIM_NAME`, set it on ``model`` (a
    Llama-style causal LM with rotary embeddings) and take the model's layer count and RoPE
    frequencies into :class:`Sim`."""
    from transformers import AttentionInterface

    AttentionInterface.register(SIM_NAME, Sim.attention)
    model.set_attn_implementation(SIM_NAME)
    Sim.num_layers = model.config.num_hidden_layers
    Sim.inv_freq = model.model.rotary_emb.inv_freq.detach().float().cpu()
