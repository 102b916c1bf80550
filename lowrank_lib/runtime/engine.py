"""The decode engine: packed projections, RoPE, MLP and sampling over a pluggable KV store.

    >>> eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=640))            # dense static KV
    >>> eng = Engine(model, EngineConfig(max_seq_len=640), kv=MethodStore(method))  # any KVStore (lowrank_lib.kv)
    >>> out = eng.generate(input_ids, max_new_tokens=64)      # greedy
    >>> out.tokens, out.timings, eng.report()

The engine reads ANY Llama-family model in the one factorized representation (``nn.Linear``,
``LowRankLinear``, shared-basis ``LowRankLinear``, mixed) and copies the weights it needs into its
own packed tensors once. ONE layer function serves prefill (T rows per sequence: exact attention over
the prompt; the store keeps what it needs) and decode (1 row: the store appends the token and attends).
The engine owns ONE position counter (:class:`~lowrank_lib.runtime.kv.Cursor`), advanced once per step
by :meth:`Engine.step` (and once after a prefill); the store owns the past tokens
(:mod:`lowrank_lib.runtime.kv`). The loop, sampler and output type are :mod:`lowrank_lib.generation`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..factorized import LowRankLinear
from ..generation import GenerateOutput, left_pad_counts, run_generation
from ..geometry import geometry
from .attention import prefill_attention
from .config import EngineConfig
from .kernels.gemv import select_gemv
from .kv import CacheFullError, Cursor, KVSpec, KVStore, StepContext, additive_mask, make_store
from .lm_head import CertifiedHead, head_report, make_lm_head
from .packing import ProjectionGroup
from .rope import apply_rope, rope_table, rotary_rows


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama does it (fp32 statistics, weight * x.to(dtype)); w None = no weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y if w is None else w * y


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: ProjectionGroup
    o: ProjectionGroup
    ln2: torch.Tensor
    gate_up: ProjectionGroup
    down: ProjectionGroup


class Engine:
    """Decode runtime over one factorized (or dense) Llama-family model.

    Parameters
    ----------
    model : ``LlamaForCausalLM``-like (``model.model.layers[i].self_attn.{q,k,v,o}_proj``,
        ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``,
        ``model.model.norm``, ``model.model.rotary_emb``, ``lm_head``).
    config : :class:`EngineConfig`.
    kv : a :class:`~lowrank_lib.runtime.kv.KVStore` (allocated here); None = the store named by
        ``config.kv`` (``"dense"`` or ``"rebuild"``).
    weights_of : another Engine of the SAME model whose packed weights this one reads instead of packing its own
        (the weights are only read at decode): engines side by side with different KV stores then hold one copy
        of the weights, not one each. Refused (ValueError) when the two would pack differently (dtype, device,
        layout, packing, kernels, RoPE / norm folding, LM head).
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, kv: KVStore | None = None,
                 weights_of: "Engine | None" = None):
        self.config = cfg = config or EngineConfig()
        if kv is not None and cfg.kv != "dense":
            raise ValueError(f"Engine got a store ({type(kv).__name__}) and EngineConfig(kv={cfg.kv!r}): the store "
                             f"replaces the KV mode; leave EngineConfig(kv='dense')")
        self.kv: KVStore = kv if kv is not None else make_store(cfg.kv)
        if cfg.graph != "none" and not self.kv.capturable:
            raise ValueError(f"the {self.kv.name!r} KV store grows its work with the history: it runs eagerly "
                             f"(graph='none'), got graph={cfg.graph!r}")
        hf = model.config
        p0 = next(model.parameters())
        self.device = torch.device(cfg.device) if cfg.device else p0.device
        self.dtype = cfg.dtype or p0.dtype
        g = geometry(model)
        self.n_layers, self.hidden = g.n_layers, g.hidden
        self.n_heads, self.n_kv, self.head_dim = g.n_heads, g.n_kv_heads, g.head_dim
        self.eps = hf.rms_norm_eps
        act = getattr(hf, "hidden_act", "silu")
        self._act = F.silu if act in ("silu", "swish") else model.model.layers[0].mlp.act_fn
        dev, dt = self.device, self.dtype
        cv = lambda t: t.detach().to(device=dev, dtype=dt).contiguous()
        if weights_of is None:
            self.embed = cv(model.get_input_embeddings().weight)
            self.norm = cv(model.model.norm.weight)
        # RoPE folding doubles the stored rows of q/k: cheap for a low-rank U [out, r], a bad trade for
        # a dense W [out, in] (decode is bandwidth bound), so it applies when every q/k is low rank; a
        # store of latents rebuilds keys from the unfolded U.
        lr_qk = all(isinstance(getattr(L.self_attn, n), LowRankLinear) for L in model.model.layers
                    for n in ("q_proj", "k_proj"))
        fold = cfg.fold_rope and not self.kv.stores_latents and lr_qk
        self.fold, self.fold_norm = fold, cfg.fold_norm
        nw = (lambda w: w) if cfg.fold_norm else (lambda w: None)
        compiled = cfg.graph != "none" and self.device.type == "cpu"
        self.gemv = select_gemv(cfg.kernels, self.device, dt, compiled, cfg.fused_compile)
        self._packing = {"dtype": dt, "device": self.device, "fold_rope": fold, "fold_norm": cfg.fold_norm,
                         "weight_layout": cfg.weight_layout, "fused_compile": cfg.fused_compile, "gemv": self.gemv,
                         "pack_qkv": cfg.pack_qkv, "pack_mlp": cfg.pack_mlp, "lm_head": cfg.lm_head}
        if weights_of is not None:
            differ = [k for k, v in self._packing.items() if weights_of._packing.get(k) != v]
            if differ or weights_of.n_layers != self.n_layers or weights_of.hidden != self.hidden:
                raise ValueError(f"weights_of: that engine packs its weights differently ({', '.join(differ) or 'geometry'}"
                                 f"): build this one with its own weights")
            self.embed, self.norm, self.lm_head = weights_of.embed, weights_of.norm, weights_of.lm_head
        lay = dict(layout=cfg.weight_layout, fuse_gemv=cfg.fused_compile, gemv=self.gemv)
        if weights_of is None:
            self.lm_head = make_lm_head(cfg.lm_head, ProjectionGroup(
                {"lm_head": model.get_output_embeddings()}, True, dt, dev, in_scale=nw(model.model.norm.weight), **lay))
        rope = {"q_proj": (self.n_heads, self.head_dim), "k_proj": (self.n_kv, self.head_dim)} if fold else {}
        self.layers: list[_Layer] = list(weights_of.layers) if weights_of is not None else []
        for L in (model.model.layers if weights_of is None else []):
            a, m = L.self_attn, L.mlp
            w1, w2 = L.input_layernorm.weight, L.post_attention_layernorm.weight
            self.layers.append(_Layer(
                cv(w1),
                ProjectionGroup({"q_proj": a.q_proj, "k_proj": a.k_proj, "v_proj": a.v_proj}, cfg.pack_qkv, dt, dev,
                                rope, in_scale=nw(w1), **lay),
                ProjectionGroup({"o_proj": a.o_proj}, True, dt, dev, **lay),
                cv(w2),
                ProjectionGroup({"gate_proj": m.gate_proj, "up_proj": m.up_proj}, cfg.pack_mlp, dt, dev,
                                in_scale=nw(w2), **lay),
                ProjectionGroup({"down_proj": m.down_proj}, True, dt, dev, **lay)))
        S = cfg.max_seq_len
        self.cs_table = rope_table(model, S, dt, dev)              # [Smax, 2, D] (cos, sin) per position
        self._rotary = model.model.rotary_emb                      # RoPE past Smax (the probe forward)
        self._slots = torch.arange(S, device=dev)
        self.cursor = Cursor(cfg.max_batch, S, dev)
        self.kv.allocate(KVSpec(
            self.n_layers, self.n_heads, self.n_kv, self.head_dim, cfg.max_batch, S, dt, dev, self.cursor,
            graphs=cfg.graph != "none", attention=cfg.attention, fused_compile=cfg.fused_compile, kernels=cfg.kernels,
            latent_dims=[(l.qkv.latent_dim(1), l.qkv.latent_dim(2)) for l in self.layers],
            expand=lambda i, j, h: self.layers[i].qkv.stage2(j, h), rope_table=self.cs_table,
            rope_at=self.rope_at, probe=self.probe))
        self.backend = self.kv.backend
        from .kernels.layer import FusedLayer, FusedStack, select_fused_layer

        self.fused = select_fused_layer(cfg.fused_layer, self.gemv, self.kv, self._groups()[1:], self._act is F.silu,
                                        cfg.max_batch)
        self._fused = [FusedLayer(self, i) for i in range(self.n_layers)] if self.fused.enabled else None
        # every layer in one call per step (decode_stack, or decode_stack_tiers on a tiered store)
        self._stack = FusedStack(self._fused) if self._fused else None
        self._B = None
        from .graphs import GraphRunner

        self.graphs = GraphRunner(self) if cfg.graph != "none" else None
        self.capture_s = 0.0

    # ------------------------------------------------------------------ accounting
    def _groups(self) -> list[ProjectionGroup]:
        return [self.lm_head] + [g for l in self.layers for g in (l.qkv, l.o, l.gate_up, l.down)]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (packed tensors, norms, lm_head; embedding rows ~0)."""
        groups = self._groups()
        norms = [self.norm] + [t for l in self.layers for t in (l.ln1, l.ln2)]
        return sum(g.nbytes for g in groups) + sum(t.numel() * t.element_size() for t in norms)

    def report(self) -> dict:
        """What runs and why: the attention backend, the GEMV backend (with the kernel library's state),
        graph / compile mode and every compile's time and cache hits, the store, bytes."""
        from .kernels.build import status

        return {"backend": self.backend.name, "backend_reason": self.backend.reason, "rope_folded": self.fold,
                "gemv": self.gemv.name, "gemv_reason": self.gemv.reason, "kernels": status(),
                "fused_layer": self.fused.name, "fused_layer_reason": self.fused.reason,
                "lm_head": head_report(self.lm_head),
                "graph": self.config.graph, "graph_impl": self.graphs.impl if self.graphs else "eager",
                "capture_s_total": self.capture_s, "compiles": list(self.graphs.compiles) if self.graphs else [],
                "kv": self.kv.name, "kv_cache_bytes": self.kv.nbytes,
                "kv_store": self.kv.report(), "weight_bytes_per_token": self.weight_bytes_per_token(),
                "stored_weight_bytes": sum(g.stored_nbytes for g in self._groups()),
                "config": self.config.to_dict()}

    # ------------------------------------------------------------------ building blocks
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm; its weight is already folded into the next GEMM when ``fold_norm``."""
        return _rms(x, None if self.fold_norm else w, self.eps)

    def _rope(self, y: torch.Tensor, cs: torch.Tensor, n_kv: int, g: int) -> torch.Tensor:
        return apply_rope(y, cs, n_kv, g, self.head_dim, self.fold)

    def _attn_block(self, i: int, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """THE layer function's attention half, prefill and decode alike: x [B*T, H] -> x + attention.

        Prefill (``ctx.prefill``): the store keeps the prompt's q/k/v (or latents) and attention runs
        exactly over the prompt. Decode (T = 1): the store appends the token's k/v and attends.
        """
        L, kv = self.layers[i], self.kv
        B, T, Hq, Hkv, D = ctx.B, ctx.T, self.n_heads, self.n_kv, self.head_dim
        h = self._norm(x, L.ln1)
        if kv.stores_latents:                                    # the store keeps k/v rank-space latents
            hs = L.qkv.stage1(h)
            mq, mk, mv = L.qkv.members
            kept = hs[mk.first].view(B, T, -1), hs[mv.first].view(B, T, -1)          # [B, T, r]
            yq = L.qkv.stage2(0, hs[mq.first])
            if ctx.prefill:
                yk, v = L.qkv.stage2(1, hs[mk.first]), L.qkv.stage2(2, hs[mv.first])
        else:
            yq, yk, v = L.qkv(h)                                 # stage 1 + every stage-2 factor
        q = self._rope(yq, ctx.rope, Hkv, Hq // Hkv)                                  # [B*T, Hkv, G, D]
        if ctx.prefill or not kv.stores_latents:
            k = self._rope(yk, ctx.rope, Hkv, 1)                                      # [B*T, Hkv, 1, D]
        if ctx.prefill:
            q = q.view(B, T, Hq, D).transpose(1, 2)                                   # [B, Hq, T, D]
            k = k.view(B, T, Hkv, D).transpose(1, 2)                                  # [B, Hkv, T, D]
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            kv.store_prefill(i, q, *(kept if kv.stores_latents else (k, v)))
            o = prefill_attention(q, k, v, ctx.mask).transpose(1, 2).reshape(B * T, Hq * D)
        else:
            if not kv.stores_latents:
                kept = k, v.view(B, Hkv, 1, D)                                        # k: [B, Hkv, 1, D] already
            kv.append(i, *kept, ctx)
            o = kv.attend(i, q, ctx)                                                  # [B, Hq * D]
        return x + L.o(o)[0]

    def _mlp_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        L = self.layers[i]
        g, u = L.gate_up(self._norm(x, L.ln2))
        return x + L.down(self._act(g) * u)[0]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.norm))[0]

    def _step_rope(self, B: int) -> torch.Tensor:
        """(cos, sin) of the token at slot cursor.length for each row (left pad shifts positions): [B,2,1,1,D]."""
        c = self.cursor
        return self.cs_table[(c.length - c.pad[:B]).clamp_min(0)].view(B, 2, 1, 1, self.head_dim)

    def step_context(self, B: int, live: int | None) -> StepContext:
        """The decode context of one step (the store's; RoPE of this token from the engine's cursor)."""
        return self.kv.step_context(B, live, self._step_rope(B))

    def decode_body(self, tokens: torch.Tensor, live: int | None = None) -> torch.Tensor:
        """One decode step, all on device: tokens [B] -> logits [B, V]; writes the token's K/V at slot
        ``cursor.length``. ``live``: slots read (eager) or None (graphs). Does not move the cursor."""
        if self._fused is not None:
            x, c = F.embedding(tokens, self.embed), self.cursor
            if self._stack is not None:              # one lowrank_lrk::decode_stack(_tiers) call for every layer
                x = self._stack(x, self.cs_table, self.kv, c.length, c.pad)
            else:                                    # one lowrank_lrk::decode_layer(_tiers) call per layer
                for f in self._fused:
                    x = f(x, self.cs_table, self.kv, c.length, c.pad)
            return self.lm_head(x)[0]                # the last layer's op applied the final norm
        ctx = self.step_context(tokens.shape[0], live)
        x = F.embedding(tokens, self.embed)
        for i in range(self.n_layers):
            x = self._attn_block(i, x, ctx)
            x = self._mlp_block(i, x)
        return self._head(x)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, D] fp32 at any ``positions`` [n] (the model's rotary module)."""
        cs = rotary_rows(self._rotary, positions, torch.float32, self.device)
        return cs[:, 0], cs[:, 1]

    @torch.no_grad()
    def probe(self, ids: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
        """A forward of ``ids`` [b, n] after ``past`` (per layer post-RoPE k, v [b, Hkv, P, D]; the new tokens at
        positions P .. P + n - 1, attending to all of ``past`` and causally to each other) -> per layer the
        post-RoPE queries [b, Hq, n, D] and the tokens' own keys [b, Hkv, n, D]. Nothing is stored and the
        cursor does not move: the reconstruction forward a model-scope KV scorer (KVzip) runs on the prompt."""
        ids = ids.to(self.device)
        b, n = ids.shape
        P = past[0][0].shape[2]
        Hq, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        pos = torch.arange(P, P + n, device=self.device)
        cs = (self.cs_table[pos] if P + n <= self.cs_table.shape[0] else
              rotary_rows(self._rotary, pos, self.dtype, self.device))
        cs = cs[None].expand(b, n, 2, D).reshape(b * n, 2, 1, 1, D)
        ok = torch.ones(n, P + n, dtype=torch.bool, device=self.device)
        ok[:, P:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = additive_mask(ok, self.dtype)[None, None]
        x = F.embedding(ids.reshape(-1), self.embed)                              # [b*n, H]
        out = []
        for i, L in enumerate(self.layers):
            yq, yk, v = L.qkv(self._norm(x, L.ln1))
            q = self._rope(yq, cs, Hkv, Hq // Hkv).view(b, n, Hq, D).transpose(1, 2)     # [b, Hq, n, D]
            k = self._rope(yk, cs, Hkv, 1).view(b, n, Hkv, D).transpose(1, 2)             # [b, Hkv, n, D]
            v = v.view(b, n, Hkv, D).transpose(1, 2)
            out.append((q, k))
            if i == self.n_layers - 1:
                break
            pk, pv = past[i]
            o = prefill_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), mask)
            x = x + L.o(o.transpose(1, 2).reshape(b * n, Hq * D))[0]
            x = self._mlp_block(i, x)
        return out

    # ------------------------------------------------------------------ runner interface (runtime.runner.Runner)
    def prepare(self, B: int) -> float:
        """Capture graphs / compile the step for batch B (no-op without graphs). Returns seconds."""
        return self.graphs.prepare(B) if self.graphs is not None else 0.0

    def invalidate(self) -> None:
        """Drop every capture / compiled step (thread count or weights changed in place); the next
        :meth:`prepare` or step captures again. Nothing to drop eagerly."""
        if self.graphs is not None:
            self.graphs.invalidate()

    @property
    def compiled(self) -> bool:
        """Decode replays a captured graph / compiled step (``EngineConfig.graph`` is not ``"none"``)."""
        return self.graphs is not None

    @property
    def lm_head_mode(self) -> str:
        """``"exact"`` or ``"certified"`` (``EngineConfig.lm_head``)."""
        return self.config.lm_head

    def counters(self) -> dict:
        """Since the last :meth:`reset_counters`: the LM head's paths (the certified head's calls, certified and
        fallback; empty for the exact head) and the graph runner's compile records."""
        return {"lm_head": self.lm_head.report() if isinstance(self.lm_head, CertifiedHead) else {},
                "compiles": list(self.graphs.compiles) if self.graphs is not None else []}

    def layer_sections(self, mark):
        """The eager step calls ``mark(i)`` / ``mark(None)`` around decoder layer ``i`` (the fused layers, or the
        attention and MLP blocks of the per-op step) until the returned undo is called."""
        def marked(i, fn):
            def run(*a, **k):
                mark(i)
                try:
                    return fn(*a, **k)
                finally:
                    mark(None)
            return run

        if self._fused is not None:                  # one call per layer while marked (no decode_stack)
            orig, stack = list(self._fused), self._stack
            self._fused[:], self._stack = [marked(i, f) for i, f in enumerate(orig)], None

            def undo_fused():
                self._fused[:], self._stack = orig, stack
            return undo_fused
        blocks = ("_attn_block", "_mlp_block")
        for name in blocks:                      # instance attributes over the methods, deleted by the undo
            block = getattr(self, name)
            setattr(self, name, lambda i, *a, _b=block, **k: marked(i, _b)(i, *a, **k))

        def undo():
            for name in blocks:
                delattr(self, name)
        return undo

    def reset_counters(self) -> None:
        """Zero :meth:`counters` (the certified head's statistics, the compile records)."""
        if isinstance(self.lm_head, CertifiedHead):
            self.lm_head.reset_stats()
        if self.graphs is not None:
            self.graphs.compiles.clear()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the prompt [B, T]; the store keeps it. Returns logits [B, V] ([B, T, V] if all_logits)."""
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if B > self.config.max_batch:
            raise CacheFullError(f"batch {B} exceeds EngineConfig.max_batch={self.config.max_batch}")
        self.cursor.check_room(T)
        pad = left_pad_counts(None if attention_mask is None else attention_mask.to(self.device), input_ids)
        self.cursor.reset(pad)
        self.kv.reset(B, T, input_ids)
        self._B = B
        slots = self._slots[:T]
        posn = (slots[None, :] - pad[:, None]).clamp_min(0)                    # [B, T]
        cs = self.cs_table[posn].reshape(B * T, 2, 1, 1, self.head_dim)
        ok = (slots[None, :] <= slots[:, None])[None] & (slots[None, None, :] >= pad[:, None, None])
        ok = ok | torch.eye(T, dtype=torch.bool, device=self.device)[None]    # pad rows see themselves (no NaN)
        ctx = StepContext(B, T, True, cs, additive_mask(ok, self.dtype)[:, None], slots)
        x = F.embedding(input_ids.reshape(-1), self.embed)                     # [B*T, H]
        for i in range(self.n_layers):
            x = self._attn_block(i, x, ctx)
            x = self._mlp_block(i, x)
        self.kv.end_prefill()
        self.cursor.advance(T)
        if not all_logits:
            x = x.view(B, T, -1)[:, -1]
        logits = self._head(x)
        return logits.view(B, T, -1) if all_logits else logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row: tokens [B] -> logits [B, V]."""
        if self._B is None:
            raise RuntimeError("call prefill() before step()")
        tokens = tokens.to(self.device)
        if tokens.shape != (self._B,):
            raise ValueError(f"step() expects tokens of shape ({self._B},), got {tuple(tokens.shape)}")
        c = self.cursor
        c.check_room(c.host + 1)
        if self.graphs is not None:
            logits = self.graphs.step(tokens)
        else:
            logits = self.decode_body(tokens, live=c.host + 1)
        c.advance()
        return logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask=None, **kw) -> GenerateOutput:
        """Greedy (default) or sampled generation; see :func:`lowrank_lib.generation.run_generation`.

        The whole request must fit: prompt + max_new_tokens - 1 <= max_seq_len, else ``CacheFullError``
        is raised before any work (documented policy: no truncation).
        """
        T = input_ids.shape[1]
        self.cursor.check_room(T + max_new_tokens - 1)
        out = run_generation(self, input_ids, max_new_tokens, attention_mask, **kw)
        out.info = {**self.report(), **out.info}
        return out
