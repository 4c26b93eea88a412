"""What a quality configuration (:mod:`.configs`) means for a model: its bits per layer and kv head,
the TQCache that holds it, its bits/element, and its calibrated widths measured on the model.

``cfg`` below is a configuration dict (None: full precision); ``num_layers`` the model's decoder
layers. A configuration with calibrated widths (``k_cal``, ``k_hcal``, ``copy_heads``) is *resolved*
on a model (:class:`Resolver`) into explicit ``k_layer_bits`` / ``head_bits`` before use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .configs import (
    BASE,
    CONFIGS,
    DEFAULT,
    LONG,
    NO_WINDOW_DEFAULT,
    PRODUCT,
    QUICK,
    UNCALIBRATED_DEFAULT,
)

Config = Mapping[str, Any]

__all__ = [
    "BASE",
    "CONFIGS",
    "DEFAULT",
    "LONG",
    "NO_WINDOW_DEFAULT",
    "PRODUCT",
    "QUICK",
    "RESEARCH_TRANSFORMS",
    "UNCALIBRATED_DEFAULT",
    "Resolver",
    "config_bits",
    "head_bits_of",
    "k4_layers",
    "key_bits_of",
    "layer_set",
    "load_copy_sensitivity",
    "load_head_sensitivity",
    "protected_layers",
    "simulation_only",
    "tq_cache",
    "tq_options",
    "v2_layers",
]

# transforms only the simulation implements (flash_attn_tq.testing.simulation.KeyValueTransform)
RESEARCH_TRANSFORMS = ("key_scale", "key_scale_q", "key_pca", "value_pca")


def layer_set(which: str | None, num_layers: int) -> set[int]:
    """The layers a named set picks: first_half, last_half, even, middle (the middle half),
    first_quarter (rounded up: 8 of 30), last_3q; none for None or another name."""
    if which == "first_half":
        return set(range(num_layers // 2))
    if which == "even":
        return set(range(0, num_layers, 2))
    if which == "last_half":
        return set(range(num_layers // 2, num_layers))
    if which == "middle":
        return set(range(num_layers // 4, num_layers // 4 + num_layers // 2))
    if which == "first_quarter":
        return set(range(-(-num_layers // 4)))
    if which == "last_3q":
        return set(range(num_layers // 4, num_layers))
    return set()


def k4_layers(cfg: Config | None, num_layers: int) -> set[int]:
    """Layers whose keys get 4 bits in the mixed-width configs (``k4_layers``)."""
    return layer_set(cfg.get("k4_layers") if cfg else None, num_layers)


def v2_layers(cfg: Config | None, num_layers: int) -> set[int]:
    """Layers whose values get 2 bits in the mixed-width configs (``v2_layers``)."""
    return layer_set(cfg.get("v2_layers") if cfg else None, num_layers)


def key_bits_of(cfg: Config, layer: int, num_layers: int) -> int:
    """Key bits of ``layer``: calibrated per layer (``k_cal``, resolved into ``k_layer_bits``), 4 in
    ``k4_layers``, else ``k_bits``."""
    if cfg.get("k_layer_bits") is not None:
        return cfg["k_layer_bits"].get(layer, cfg["k_bits"])
    return 4 if layer in k4_layers(cfg, num_layers) else cfg["k_bits"]


def head_bits_of(cfg: Config, layer: int) -> dict[int, tuple[int, int]]:
    """``{kv head: (K bits, V bits)}`` of ``layer``'s heads whose widths differ from the layer's
    (a resolved config's ``head_bits``, keyed ``"layer,head"``)."""
    out = {}
    for key, widths in (cfg.get("head_bits") or {}).items():
        i, h = (int(x) for x in key.split(","))
        if i == layer:
            out[h] = tuple(widths)
    return out


def protected_layers(cfg: Config | None, num_layers: int) -> set[int]:
    """Layers kept in 16-bit: ``protect="boundary"`` is the first and the last one."""
    if cfg is None or not cfg.get("protect"):
        return set()
    if cfg["protect"] == "boundary":
        return {0, num_layers - 1}
    return set(cfg["protect"])


def tq_options(cfg: Config) -> dict[str, Any]:
    """TQCache keyword options of a config (besides its per-layer and per-head ones): the codes'
    options, the 16-bit tokens, the key center (``rope_center="exact"`` is ``key_center="rope"``);
    a recent band of codes (``recent_window``) is TQCache's window at ``window_bits``. ValueError
    for a band TQCache cannot hold (after a 16-bit window, or of two widths)."""
    opts = {
        k: cfg[k]
        for k in ("quantizer", "k_bits", "v_bits", "fit", "fp16_window", "sink_tokens", "key_center", "scale_only")
    }
    if opts["quantizer"] == "asym":
        opts.pop("fit")
    if cfg.get("rope_center") == "exact":  # (TQCache takes the RoPE frequencies from the model config)
        opts["key_center"] = "rope"
    if cfg.get("recent_window"):  # age-based precision: TQCache's window as codes of recent_bits
        rk, rv = cfg["recent_bits"]
        if opts["fp16_window"] or rk != rv:
            raise ValueError("TQCache holds a recent window of one bit width without a 16-bit window before it")
        opts.update(fp16_window=cfg["recent_window"], window_bits=rk)
    return opts


def simulation_only(cfg: Config | None) -> list[str]:
    """The options of a config that only the simulation implements (no TQCache equivalent)."""
    names = ("klt", "qjl", "value_center", "mean_error", "rope_center_pairs", "recent_raw", *RESEARCH_TRANSFORMS)
    out = [k for k in names if cfg and cfg.get(k)]
    if cfg and cfg.get("rope_center") not in (None, False, "exact"):
        out.append(f"rope_center={cfg['rope_center']}")
    return out


def tq_cache(model: Any, cfg: Config, prefill: str = "full", max_cache_len: int | None = None) -> Any:
    """The TQCache that holds a (resolved) config as the simulation applies it: its options,
    per-layer key bits (k_cal / k4_layers), 2-bit value layers, per-head widths (k_hcal / copy
    heads), protected layers. ValueError for what only the simulation has (:func:`simulation_only`)."""
    from ..integrations.transformers import TQCache

    sim_only = simulation_only(cfg)
    if sim_only:
        raise ValueError(f"simulation-only options, no TQCache equivalent: {', '.join(sim_only)}")
    L = model.config.num_hidden_layers
    per_layer = {i: {"k_bits": key_bits_of(cfg, i, L)} for i in range(L) if key_bits_of(cfg, i, L) != cfg["k_bits"]}
    for i in v2_layers(cfg, L):
        per_layer.setdefault(i, {})["v_bits"] = 2
    heads = {
        tuple(int(x) for x in k.split(",")): {"k_bits": kb, "v_bits": vb}
        for k, (kb, vb) in cfg.get("head_bits", {}).items()
    }
    return TQCache(
        model.config,
        prefill=prefill,
        max_cache_len=max_cache_len,
        protected_layers=protected_layers(cfg, L),
        layer_options=per_layer,
        late_k_bits=None,
        head_options=heads,
        **tq_options(cfg),
    )


def config_bits(cfg: Config | None, head_dim: int, num_layers: int) -> float:
    """Bits a cached K/V element costs on average over the layers (codes and their metadata; 16 for
    full precision and for protected layers), as TQCache's ``bits_per_element`` counts them."""
    from ..format import bits_per_element

    if cfg is None:
        return 16.0
    if cfg.get("klt"):  # codes + one float16 gain a token for K and for V
        return (cfg["klt"]["kb"] + cfg["klt"]["vb"]) / 2 + 16.0 / head_dim
    meta = -16.0 / head_dim if cfg.get("scale_only") else 0.0  # bits_per_element counts fp16 scale + offset
    k_codes = sum(key_bits_of(cfg, i, num_layers) for i in range(num_layers)) / num_layers
    heads = [(key_bits_of(cfg, i, num_layers), w) for i in range(num_layers) for w in head_bits_of(cfg, i).values()]
    k_codes += sum(kb - layer_kb + vb - cfg["v_bits"] for layer_kb, (kb, vb) in heads) / (
        num_layers * cfg.get("kv_heads", 1)
    )
    k_bits = bits_per_element(head_dim, cfg["k_bits"]) + (k_codes - cfg["k_bits"]) + meta
    k_bits += 1.0 if cfg.get("qjl") else 0.0  # the sign sketch
    v_bits = (
        bits_per_element(head_dim, cfg["v_bits"]) - len(v2_layers(cfg, num_layers)) * (cfg["v_bits"] - 2) / num_layers
    )
    q = (k_bits + v_bits + meta) / 2
    prot = len(protected_layers(cfg, num_layers))
    return (q * (num_layers - prot) + 16.0 * prot) / num_layers


# ------------------------------------------------------------------------- calibrated widths


def load_head_sensitivity(path: str | Path) -> tuple[dict, dict] | None:
    """``(options, {(layer, kv head, K bits, V bits): KL})`` of a saved head_sensitivity measurement
    (``head_sensitivity()`` over the default options, saved as JSON), or None where ``path`` is absent."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["options"], {tuple(int(x) for x in k.split(",")): v for k, v in data["kl"].items()}


def load_copy_sensitivity(path: str | Path) -> tuple[dict, dict] | None:
    """``(options, {(layer, kv head, K bits, V bits): copy-span KL})`` averaged over COPY_SEEDS, from a
    saved head_objectives measurement (random-token sequences of 1024 tokens), or None."""
    from ..integrations.calibration import COPY_SEEDS

    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    runs = [data["kl"].get(f"copy|syn|1k|{s}") for s in COPY_SEEDS]
    if any(r is None for r in runs):
        return None
    kl = {tuple(int(x) for x in k.split(",")): sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    return data["options"], kl


class Resolver:
    """Resolves configurations on a model: ``resolver(cfg, model)`` is ``cfg`` with its calibrated
    widths measured (``k_cal``: key bits a layer, :func:`calibrate_key_bits`; ``k_hcal``: widths a
    kv head, :func:`calibrate_head_bits`; ``copy_heads``: the K8V8 copy heads,
    :func:`calibrate_copy_heads`) as ``k_layer_bits`` / ``head_bits``; other configs as they are.

    The sensitivities measured are kept by the options and widths they were measured at (one
    measurement serves every config that shares them). ``head_sensitivity`` / ``copy_sensitivity``:
    saved measurements (JSON, see :func:`load_head_sensitivity` / :func:`load_copy_sensitivity`),
    used where their options match the config's instead of measuring again (tens of minutes on
    two cores)."""

    def __init__(self, head_sensitivity: str | Path | None = None, copy_sensitivity: str | Path | None = None):
        self.head_sensitivity = head_sensitivity
        self.copy_sensitivity = copy_sensitivity
        self.measured: dict = {}

    def __call__(self, cfg: Config | None, model: Any) -> dict | None:
        if cfg and cfg.get("k_hcal") and cfg.get("head_bits") is None:
            return self.resolve_heads(cfg, model)
        if not cfg or not cfg.get("k_cal") or cfg.get("k_layer_bits") is not None:
            return None if cfg is None else dict(cfg)
        from ..integrations.calibration import calibrate_copy_heads, calibrate_key_bits, key_bit_sensitivity

        L = model.config.num_hidden_layers
        opts = tq_options(cfg)
        opts.pop("k_bits")
        if cfg.get("rope_center") and not cfg.get("cal_own_center"):  # the bits placed as measured with the
            opts["key_center"] = True  # post-RoPE centering (as TQCache.calibrated places them; "Kcal34rc": its own)
        prot = protected_layers(cfg, L)
        tokens = cfg.get("k_cal_tokens", 1024)
        key = (tuple(sorted(opts.items())), tuple(sorted(prot)), tuple(cfg["k_cal"]), tokens)
        if key not in self.measured:
            self.measured[key] = key_bit_sensitivity(
                model, bits=cfg["k_cal"], protected_layers=prot, tokens=tokens, **opts
            )
        heads, spent = {}, 0
        if cfg.get("copy_heads"):
            saved = load_copy_sensitivity(self.copy_sensitivity) if self.copy_sensitivity else None
            usable = saved and not prot and all(saved[0].get(k) == v for k, v in opts.items())
            heads = calibrate_copy_heads(
                model,
                heads=cfg["copy_heads"],
                protected_layers=prot,
                sensitivity=saved[1] if usable else None,
                k_bits=cfg["k_bits"],
                **opts,
            )
            spent = sum(o["k_bits"] - cfg["k_bits"] + o["v_bits"] - cfg["v_bits"] for o in heads.values())
        chosen = calibrate_key_bits(
            model,
            bits=cfg["k_cal"],
            protected_layers=prot,
            sensitivity=self.measured[key],
            k_bits=cfg["k_bits"],
            spent=spent,
            **opts,
        )
        out = dict(cfg, k_layer_bits={i: o["k_bits"] for i, o in chosen.items()})
        if heads:
            out.update(
                head_bits={f"{i},{h}": [o["k_bits"], o["v_bits"]] for (i, h), o in sorted(heads.items())},
                kv_heads=model.config.num_key_value_heads,
            )
        return out

    def resolve_heads(self, cfg: Config, model: Any) -> dict:
        """``cfg`` (with ``k_hcal``) with its kv heads' widths measured as ``head_bits``."""
        from ..integrations.calibration import calibrate_head_bits, head_sensitivity

        L = model.config.num_hidden_layers
        opts = tq_options(cfg)
        opts.pop("k_bits")
        prot = protected_layers(cfg, L)
        key = ("heads", tuple(sorted(opts.items())), tuple(sorted(prot)))
        saved = load_head_sensitivity(self.head_sensitivity) if self.head_sensitivity else None
        if key not in self.measured and not prot and saved and all(saved[0].get(k) == v for k, v in opts.items()):
            self.measured[key] = saved[1]
        if key not in self.measured:  # (every width at once: keys at 3 and 4, values at 3, the 8-bit floor)
            self.measured[key] = head_sensitivity(
                model, key_bits=(3, 4), value_bits=(3,), protected_layers=prot, **opts
            )
        chosen = calibrate_head_bits(
            model,
            widths=cfg["k_hcal"],
            protected_layers=prot,
            sensitivity=self.measured[key],
            fine_budget=cfg.get("k_hcal_8bit_units"),
            k_bits=cfg["k_bits"],
            **opts,
        )
        return dict(
            cfg,
            head_bits={f"{i},{h}": [o["k_bits"], o["v_bits"]] for (i, h), o in sorted(chosen.items())},
            kv_heads=model.config.num_key_value_heads,
        )
