"""The transformers adapter: ONE ``Cache`` (the ``CacheLayerMixin`` API) that serves every KV method.

    >>> cache = KVCache(make_method("snapkv", budget=0.25), model, tok)
    >>> with cache.serving(model):                  # routes attention; fits right after the prefill forward
    ...     out = model.generate(ids, attention_mask=mask, **cache_kw(cache), max_new_tokens=32)
    >>> prefill = record(model, ids)                 # or: record a prefill once ...
    >>> cache = KVCache.from_prefill(method, prefill)    # ... and fit any number of methods from it

Life cycle: the prefill forward is served exactly (each layer stores its K/V and returns them: prefill logits equal
a dense cache's) while the post-RoPE queries are captured where the method needs them; when that forward returns,
the cache builds the :class:`~lowrank_lib.kv.method.Prefill` (with the probe forward a model-scope method runs, and
the model's RoPE) and the method fits one :class:`~lowrank_lib.kv.tiers.TieredLayer` per layer. Later forwards
append their tokens through the method and attend with the ONE tiered attention (exact rows, low-rank runs in factor
space, appended rows causal; the attention mask transformers builds covers only the appended rows and is not read:
the prompt's padding was never stored). Positions: ``get_seq_length`` counts every slot (prompt, pads included, +
appended), as a dense cache would, so RoPE and ``generate``'s bookkeeping continue unchanged.

Left padding: pass ``attention_mask``; :func:`record` derives position ids from it as ``generate`` does.
"""
from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compat import cache_kw
from ..eviction.expected import model_rope
from ..geometry import geometry
from ..hf.attention import routed_attention
from .method import KVMethod, Prefill
from .tiers import BACKENDS, TieredLayer

__all__ = ["dense_cache", "KVCache", "MethodLayer", "probe_for", "record", "tiered_attention", "TieredRead"]


class TieredRead:
    """What a fitted layer hands attention in place of K and V: its state, the method that reads it and the
    attention backend of its cache."""

    def __init__(self, layer: TieredLayer, method: KVMethod, backend: str, calls: Counter | None = None):
        self.layer, self.method, self.backend, self.calls = layer, method, backend, calls

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """query [B, Hq, q, d] -> [B, q, Hq, d] (the layout transformers' attention functions return)."""
        if self.calls is not None:
            self.calls[self.backend] += 1
        return self.method.attend(self.layer, query, scaling, None, self.backend).transpose(1, 2).contiguous()

    @property
    def shape(self):
        raise TypeError("a KVCache layer reached a dense attention function: run the model inside "
                        "KVCache.serving(model)")


class MethodLayer(CacheLayerMixin):
    """One layer: the exact prefill until the method fits, then its :class:`TieredLayer`."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "KVCache"):
        super().__init__()
        self.cache = cache
        self.state: TieredLayer | None = None
        self.query: torch.Tensor | None = None      # captured post-RoPE prefill queries [B, Hq, S, d]
        self.seen = 0

    @property
    def pending(self) -> bool:
        """The prefill is held exactly and not fitted yet."""
        return self.state is None and self.is_initialized

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Prefill: store K/V [B, H, S, d] and return them (exact). Fitted: append and hand over the state."""
        if self.state is None:
            if self.is_initialized:
                raise RuntimeError("KVCache: a second forward reached a layer whose prefill was never fitted: run the "
                                   "model inside KVCache.serving(model), or build the cache with KVCache.from_prefill")
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            self.seen = key_states.shape[-2]
            return key_states, value_states
        self.cache.method.append(self.state, key_states, value_states)
        self.seen += key_states.shape[-2]
        r = TieredRead(self.state, self.cache.method, self.cache.attention, self.cache.attention_calls)
        return r, r

    def load(self, state: TieredLayer, seen: int, like: torch.Tensor) -> None:
        """Hold a fitted ``state`` for a prompt of ``seen`` slots; ``like`` gives the dtype and device."""
        self.lazy_initialization(like, like)
        self.state, self.seen = state, seen
        self.keys = self.values = self.query = None

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.state is None:
            return self.seen + query_length, 0
        n = self.state.n_new                       # appended rows held before this update
        return n + query_length, self.seen - n

    def reset(self) -> None:
        self.keys = self.values = self.query = self.state = None
        self.is_initialized = False
        self.seen = 0


class KVCache(Cache):
    """A transformers ``Cache`` serving ``method`` (any :class:`~lowrank_lib.kv.method.KVMethod`).

    model_or_config : the model (its layer count; with a model, fitting can run the probe forward a model-scope
    method needs and read the model's RoPE). tokenizer : for model-scope prompts (KVzip's instruction).
    attention : the tiered attention backend decode reads with (``kv.tiers.BACKENDS``: ``"portable"``, the factor-
    space reference; ``"rebuild"``, the paper's rebuild-then-attend).
    """

    def __init__(self, method: KVMethod, model_or_config, tokenizer=None, attention: str = "portable"):
        if attention not in BACKENDS:
            raise ValueError(f"unknown tiered attention {attention!r}; choose from {sorted(BACKENDS)}")
        self.method, self.tokenizer, self.attention = method, tokenizer, attention
        self.model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
        super().__init__(layers=[MethodLayer(self) for _ in range(geometry(model_or_config).n_layers)])
        self.prefill: Prefill | None = None
        self.fit_info: dict = {}
        #: tiered attention calls (one per layer and forward) by backend: which reader really ran
        self.attention_calls: Counter = Counter()
        self._fitting = False

    # ------------------------------------------------------------------ construction from a recorded prefill
    @classmethod
    def from_prefill(cls, method: KVMethod, prefill: Prefill, model, attention: str = "portable") -> "KVCache":
        """A cache for ``model`` holding ``method`` fitted to a recorded ``prefill`` (:func:`record`: its probe and
        RoPE come with it)."""
        cache = cls(method, model, prefill.tokenizer, attention)
        cache._load(method.fit(prefill), prefill)
        return cache

    def _load(self, states: list[TieredLayer], prefill: Prefill) -> None:
        self.prefill = prefill
        for layer, state, K in zip(self.layers, states, prefill.keys):
            layer.load(state, prefill.length, K)
        self.fit_info = self.method.describe(states, prefill)

    # ------------------------------------------------------------------ fitting after a live prefill
    def fit(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> None:
        """Fit the method to the prefill the layers hold (called by :meth:`serving` after the prefill forward)."""
        ls = self.layers
        if not all(l.pending for l in ls):
            raise RuntimeError("KVCache.fit: every layer must hold an unfitted prefill")
        if self.method.needs_queries and any(l.query is None for l in ls):
            raise RuntimeError(f"{self.method.name or type(self.method).__name__} reads the prefill's queries: run the "
                               f"prefill inside KVCache.serving(model)")
        K0 = ls[0].keys
        valid = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.bool()
        prefill = Prefill([l.keys for l in ls], [l.values for l in ls],
                          [l.query for l in ls] if self.method.needs_queries else None, self._scaling(K0), valid,
                          input_ids, None, None, self.tokenizer)
        if self.model is not None:
            prefill.probe_row = probe_for(self.model, prefill)
            prefill.rope = model_rope(self.model)
        self._fitting = True
        try:
            self._load(self.method.fit(prefill), prefill)
        finally:
            self._fitting = False

    def _scaling(self, K: torch.Tensor) -> float:
        mods = [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")] \
            if self.model is not None else []
        return float(mods[0].scaling) if mods else K.shape[-1] ** -0.5

    @contextmanager
    def serving(self, model):
        """Inside the block, ``model``'s attention reads this cache's tiers, the prefill's queries are captured
        where the method needs them, and the method is fitted as soon as a prefill forward returns."""
        self.model = model
        method = self.method

        def make(inner):
            def tiered_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
                if isinstance(key, TieredRead):
                    return key.attend(query, scaling), None
                layer = self.layers[module.layer_idx] if module.layer_idx < len(self.layers) else None
                if layer is not None and layer.pending and method.needs_queries and not self._fitting \
                        and layer.keys is key:
                    layer.query = query.detach()
                return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            return tiered_attention

        def after_forward(mod, args, kwargs, output):
            if self._fitting or not self.layers[0].pending:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.fit(ids, kwargs.get("attention_mask"))

        with ExitStack() as stack:
            stack.enter_context(routed_attention(model, make))
            h = model.register_forward_hook(after_forward, with_kwargs=True)
            stack.callback(h.remove)
            yield self

    # ------------------------------------------------------------------ bytes
    @property
    def states(self) -> list[TieredLayer]:
        return [l.state for l in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes held now (tiers + appended rows)."""
        return self.method.nbytes(self.states)

    def describe(self) -> dict:
        """The method's report of its fit, taken right after the prefill (bytes held over the dense prompt bytes:
        the budget's meaning; tier counts; the method's own knobs). Bytes held now: :attr:`nbytes`."""
        return self.fit_info


@contextmanager
def tiered_attention(model):
    """Inside the block ``model``'s attention reads the fitted layers of ANY :class:`KVCache` (each with its own
    backend); every other call (a dense cache, a prefill) goes to the attention in effect. ``KVCache.serving``
    does this too, and also captures and fits a live prefill."""
    def make(inner):
        def read(module, query, key, value, attention_mask, scaling=None, **kwargs):
            if isinstance(key, TieredRead):
                return key.attend(query, scaling), None
            return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return read

    with routed_attention(model, make):
        yield


# ---------------------------------------------------------------------------------------------------- recording
def _position_ids(attention_mask: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """Position ids of a left-padded batch as ``generate`` derives them (cumsum of the mask - 1, pads at 0)."""
    if attention_mask is None:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0).to(device)


@torch.no_grad()
def record(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, tokenizer=None,
           queries: bool = True) -> Prefill:
    """Prefill ``ids`` [B, S] once (exact, a DynamicCache) and keep every layer's post-RoPE K, V and (``queries``)
    Q, the last logits, the probe forward and the model's RoPE: a :class:`Prefill` to fit methods from."""
    L = geometry(model).n_layers
    qs: list[torch.Tensor | None] = [None] * L

    def make(inner):
        def keep_q(module, query, key, value, attention_mask, **kw):
            qs[module.layer_idx] = query.detach()
            return inner(module, query, key, value, attention_mask, **kw)
        return keep_q

    dc = DynamicCache(config=model.config)
    with routed_attention(model, make) if queries else ExitStack():
        out = model(ids, attention_mask=attention_mask, position_ids=_position_ids(attention_mask, ids.shape[1],
                                                                                    ids.device),
                    **cache_kw(dc), logits_to_keep=1)
    keys = [dc.layers[i].keys for i in range(L)]
    values = [dc.layers[i].values for i in range(L)]
    valid = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.bool()
    scaling = next(float(m.scaling) for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling"))
    p = Prefill(keys, values, qs if queries else None, scaling, valid, ids, None, model_rope(model), tokenizer,
                out.logits[:, -1].float())
    p.probe_row = probe_for(model, p)
    return p


def probe_for(model, prefill: Prefill):
    """The probe forward of ``prefill`` through ``model``: (row b, ids [1, n]) -> per layer (q, own k), run on a
    DynamicCache holding row b's valid prefix (positions continue after it), nothing kept."""
    @torch.no_grad()
    def probe(b: int, x: torch.Tensor):
        p = prefill.pad(b)
        dc = DynamicCache(config=model.config)
        for i, (K, V) in enumerate(zip(prefill.keys, prefill.values)):
            dc.update(K[b:b + 1, :, p:], V[b:b + 1, :, p:], i)
        got: dict = {}
        n = x.shape[-1]

        def make(inner):
            def keep(module, query, key, value, attention_mask, **kw):
                got[module.layer_idx] = (query.detach(), key[:, :, -n:].detach())
                return inner(module, query, key, value, attention_mask, **kw)
            return keep

        with routed_attention(model, make):
            model(x.to(prefill.keys[0].device), **cache_kw(dc), logits_to_keep=1)
        return [got[i] for i in range(prefill.n_layers)]

    return probe


def dense_cache(prefill: Prefill, model) -> DynamicCache:
    """A DynamicCache holding the recorded prefill exactly (transformers' own attention: the dense reference)."""
    dc = DynamicCache(config=model.config)
    for i, (K, V) in enumerate(zip(prefill.keys, prefill.values)):
        dc.update(K, V, i)
    return dc
