"""The decode engine: dense preallocated KV cache, packed projections, attention backends, graphs.

    >>> eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=640))
    >>> out = eng.generate(input_ids, max_new_tokens=64)      # greedy
    >>> out.tokens, out.timings, eng.report()

The engine reads ANY Llama-family model in the one factorized representation (``nn.Linear``,
``LowRankLinear``, shared-basis ``LowRankLinear``, mixed) and copies the weights it needs into its
own packed tensors once. Prefill runs the full prompt through the factorized projections with SDPA;
decode reconstructs only the current token's q/k/v, appends k/v to the static cache and attends.

The same ``run_generation`` loop drives the engine and every baseline (``baselines.py``), so
timings and token streams are comparable: a runner only needs ``prefill`` and ``step``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DECODE, fused_decode, prefill_attention, select_backend
from .config import EngineConfig
from .kv_cache import CacheFullError, StaticKVCache
from ..factorized import LowRankLinear
from .packing import ProjectionGroup

NEG_INF = float("-inf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: ProjectionGroup
    o: ProjectionGroup
    ln2: torch.Tensor
    gate_up: ProjectionGroup
    down: ProjectionGroup


@dataclass
class GenerateOutput:
    """tokens [B, n_new] (rows that hit EOS are padded with EOS); logits: per step [B, V] if asked."""

    tokens: torch.Tensor
    prefill_s: float
    step_s: list[float]
    total_s: float
    logits: list[torch.Tensor] | None = None
    info: dict = field(default_factory=dict)

    @property
    def decode_ms_per_token(self) -> float:
        """Median decode step latency in ms (one token per row per step)."""
        import statistics

        return 1e3 * statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def timings(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": sum(self.step_s), "total_s": self.total_s,
                "decode_ms_per_token_median": self.decode_ms_per_token, "steps": len(self.step_s)}


def left_pad_counts(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """[B] number of left-pad slots; refuses right padding or holes (the cache assumes left padding)."""
    B, T = input_ids.shape
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long, device=input_ids.device)
    m = attention_mask.to(torch.long)
    if m.shape != (B, T):
        raise ValueError(f"attention_mask has shape {tuple(m.shape)}, expected {(B, T)}")
    pad = T - m.sum(1)
    expect = (torch.arange(T, device=m.device)[None, :] >= pad[:, None]).long()
    if not torch.equal(m, expect):
        raise ValueError("attention_mask must be LEFT padded (zeros then ones per row); use "
                         "tokenizer.padding_side='left'")
    if (pad >= T).any():
        raise ValueError("a row of the batch has no real token")
    return pad


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B] (greedy argmax, or temperature / top-k / top-p sampling)."""
    if not do_sample:
        return logits.argmax(-1)
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, -1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if top_p < 1.0:
        srt, idx = x.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) > top_p
        srt = srt.masked_fill(drop, NEG_INF)
        x = torch.full_like(x, NEG_INF).scatter(-1, idx, srt)
    p = x.softmax(-1)
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def run_generation(runner, input_ids: torch.Tensor, max_new_tokens: int, attention_mask=None,
                   do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   eos_token_id: int | None = None, generator=None, return_logits: bool = False,
                   forced_tokens: torch.Tensor | None = None) -> GenerateOutput:
    """The ONE decode loop for the engine and all baselines.

    ``runner.prefill(input_ids [B,T], attention_mask) -> logits [B, V]`` and
    ``runner.step(tokens [B]) -> logits [B, V]``; ``runner.device``. ``forced_tokens`` [B, n]
    teacher-forces the fed tokens (perplexity through the decode path).
    """
    dev = runner.device
    B = input_ids.shape[0]
    _sync(dev)
    t0 = time.perf_counter()
    logits = runner.prefill(input_ids, attention_mask)
    _sync(dev)
    t1 = time.perf_counter()
    capture_s = runner.prepare(B) if hasattr(runner, "prepare") else 0.0   # graphs: not in decode time
    t1b = time.perf_counter()
    out, all_logits, steps = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    for i in range(max_new_tokens):
        if return_logits:
            all_logits.append(logits.float().clone())
        nxt = forced_tokens[:, i] if forced_tokens is not None else sample_next(
            logits, do_sample, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt)
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        ts = time.perf_counter()
        logits = runner.step(nxt)
        _sync(dev)
        steps.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    toks = torch.stack(out, 1) if out else torch.empty(B, 0, dtype=torch.long)
    return GenerateOutput(toks, t1 - t0, steps, (t2 - t0) - (t1b - t1), all_logits if return_logits else None,
                          {"capture_s": capture_s})


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama does it (fp32 statistics, weight * x.to(dtype)); w None = no weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y if w is None else w * y


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Engine:
    """Decode runtime over one factorized (or dense) Llama-family model.

    Parameters
    ----------
    model : ``LlamaForCausalLM``-like (``model.model.layers[i].self_attn.{q,k,v,o}_proj``,
        ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``,
        ``model.model.norm``, ``model.model.rotary_emb``, ``lm_head``).
    config : :class:`EngineConfig`.
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        hf = model.config
        p0 = next(model.parameters())
        self.device = torch.device(cfg.device) if cfg.device else p0.device
        self.dtype = cfg.dtype or p0.dtype
        self.n_layers = hf.num_hidden_layers
        self.hidden = hf.hidden_size
        self.n_heads = hf.num_attention_heads
        self.n_kv = getattr(hf, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(hf, "head_dim", None) or self.hidden // self.n_heads
        self.eps = hf.rms_norm_eps
        act = getattr(hf, "hidden_act", "silu")
        self._act = F.silu if act in ("silu", "swish") else model.model.layers[0].mlp.act_fn
        dev, dt = self.device, self.dtype
        cv = lambda t: t.detach().to(device=dev, dtype=dt).contiguous()
        self.embed = cv(model.get_input_embeddings().weight)
        self.norm = cv(model.model.norm.weight)
        # RoPE folding doubles the stored rows of q/k: cheap for a low-rank U [out, r], a bad trade for
        # a dense W [out, in] (decode is bandwidth bound), so it applies when every q/k is low rank.
        lr_qk = all(isinstance(getattr(L.self_attn, n), LowRankLinear) for L in model.model.layers
                    for n in ("q_proj", "k_proj"))
        fold = cfg.fold_rope and cfg.kv == "dense" and lr_qk
        self.fold, self.fold_norm = fold, cfg.fold_norm
        nw = (lambda w: w) if cfg.fold_norm else (lambda w: None)
        lay = dict(layout=cfg.weight_layout, fuse_gemv=cfg.fused_compile)
        self.lm_head = ProjectionGroup({"lm_head": model.get_output_embeddings()}, True, dt, dev,
                                       in_scale=nw(model.model.norm.weight), **lay)
        rope = {"q_proj": (self.n_heads, self.head_dim), "k_proj": (self.n_kv, self.head_dim)} if fold else {}
        self.layers: list[_Layer] = []
        for L in model.model.layers:
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
        # RoPE table [Smax, 2, D] = (cos, sin) per position, from the model's own rotary module
        S = cfg.max_seq_len
        pos = torch.arange(S, device=p0.device)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dt, device=p0.device), pos)
        self.cs_table = torch.stack([cos[0], sin[0]], 1).to(device=dev, dtype=dt).contiguous()
        self.backend = select_backend(cfg.attention, dev, self.head_dim, dt)
        if cfg.kv == "rebuild":
            if self.backend.name != "sdpa":
                self.backend = type(self.backend)("sdpa", "kv='rebuild' rebuilds K/V in torch and attends with sdpa", "bhsd")
            lat = [(l.qkv.latent_dim(1), l.qkv.latent_dim(2)) for l in self.layers]
        else:
            lat = None
        self.cache = StaticKVCache(self.n_layers, cfg.max_batch, S, self.n_kv, self.head_dim, dt, dev,
                                   self.backend.layout, lat)
        self._decode_attn = DECODE[self.backend.name]
        self._fused_attn = cfg.fused_compile and self.backend.name == "sdpa"
        self._slots = torch.arange(S, device=dev)
        self._B = None
        from .graphs import GraphRunner

        self.graphs = GraphRunner(self) if cfg.graph != "none" else None
        self.capture_s = 0.0

    # ------------------------------------------------------------------ accounting
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (packed tensors, norms, lm_head; embedding rows ~0)."""
        groups = [self.lm_head] + [g for l in self.layers for g in (l.qkv, l.o, l.gate_up, l.down)]
        norms = [self.norm] + [t for l in self.layers for t in (l.ln1, l.ln2)]
        return sum(g.nbytes for g in groups) + sum(t.numel() * t.element_size() for t in norms)

    def report(self) -> dict:
        return {"backend": self.backend.name, "backend_reason": self.backend.reason, "rope_folded": self.fold,
                "graph": self.config.graph, "graph_impl": self.graphs.impl if self.graphs else "eager",
                "capture_s_total": self.capture_s, "kv_cache_bytes": self.cache.nbytes,
                "weight_bytes_per_token": self.weight_bytes_per_token(), "config": self.config.to_dict()}

    # ------------------------------------------------------------------ building blocks
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm; its weight is already folded into the next GEMM when ``fold_norm``."""
        return _rms(x, None if self.fold_norm else w, self.eps)

    def _rope(self, y: torch.Tensor, cs: torch.Tensor, n_kv: int, g: int) -> torch.Tensor:
        """y [N, 2*n_kv*g*D] (folded) or [N, n_kv*g*D]; cs [N, 2, 1, 1, D] -> [N, n_kv, g, D]."""
        N, D = y.shape[0], self.head_dim
        if self.fold:
            return (y.view(N, 2, n_kv, g, D) * cs).sum(1)
        y = y.view(N, n_kv, g, D)
        return y * cs[:, 0] + _rotate_half(y) * cs[:, 1]

    def _attn_block(self, i: int, x: torch.Tensor, ctx) -> torch.Tensor:
        """Decode: x [B, H] -> x + attention [B, H]; ``ctx`` from :meth:`step_context`."""
        L = self.layers[i]
        B, Hkv, D = x.shape[0], self.n_kv, self.head_dim
        G = self.n_heads // Hkv
        h = self._norm(x, L.ln1)
        if self.config.kv == "rebuild":
            pos, cs, mask, _, _ = ctx
            return x + L.o(self._rebuild_attn(i, h, cs, pos, mask))[0]
        q, k, v = L.qkv(h)
        q = self._rope(q, ctx[1], Hkv, G)                # [B, Hkv, G, D]
        k = self._rope(k, ctx[1], Hkv, 1)                # [B, Hkv, 1, D]
        return x + L.o(self.decode_attention(i, q, k, v.view(B, Hkv, 1, D), ctx))[0]

    # ------------------------------------------------------------------ KV-mode hooks
    # A KV mode (the dense cache here; AttSVD factors in ``attsvd.factor_engine``) overrides these three:
    # what the prefill stores, what one decode step's attention needs, and how it attends.
    def prefill_kv(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Prefill of layer i: post-RoPE q [B, Hq, T, D], k/v [B, Hkv, T, D] -> stored (dense cache)."""
        if self.config.kv == "dense":
            self.cache.write(i, k, v, slots)

    def step_context(self, B: int, live: int | None):
        """What every layer's decode attention reads, built once per step: (pos [1], cs [B,2,1,1,D],
        mask [B,1,1,S] or None, Ks, Vs). Every KV mode's context starts with (pos, cs, mask).
        ``live`` = live slots (eager) or None (graphs: all Smax slots, validity from the device-side
        length / pad tensors)."""
        c = self.cache
        pos, cs = c.length, self._step_rope(B)
        Ks, Vs = c.views(B, live)
        if live is None:
            ok = (self._slots[None, :] >= c.pad[:B, None]) & (self._slots[None, :] <= pos)
        elif self._any_pad:                  # eager with padding: mask the pad slots only
            ok = self._slots[None, :live] >= c.pad[:B, None]
        else:
            return pos, cs, None, Ks, Vs
        return pos, cs, self._additive_mask(ok).view(B, 1, 1, -1), Ks, Vs

    def _step_rope(self, B: int) -> torch.Tensor:
        """(cos, sin) of the token at slot cache.length for each row (left pad shifts positions): [B,2,1,1,D]."""
        c = self.cache
        return self.cs_table[(c.length - c.pad[:B]).clamp_min(0)].view(B, 2, 1, 1, self.head_dim)

    def _additive_mask(self, ok: torch.Tensor) -> torch.Tensor:
        """bool "may attend" -> additive mask in the engine dtype (0 / -inf), same shape."""
        return torch.zeros(ok.shape, dtype=self.dtype, device=self.device).masked_fill_(~ok, NEG_INF)

    def decode_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        """Append the current token's k/v [B, Hkv, 1, D] and attend with q [B, Hkv, G, D] -> [B, Hq * D]."""
        pos, _, mask, Ks, Vs = ctx
        attn = fused_decode if self._fused_attn and torch.compiler.is_compiling() else self._decode_attn
        return attn(q, k, v, Ks[i], Vs[i], self.cache, pos, mask)

    def _rebuild_attn(self, i, h, cs, pos, mask):
        """The slow route: k/v history kept as rank-space latents, dense K/V rebuilt every step."""
        L, B, Hq, Hkv, D = self.layers[i], h.shape[0], self.n_heads, self.n_kv, self.head_dim
        hs = L.qkv.stage1(h)
        mq, mk, mv = L.qkv.members
        q = self._rope(L.qkv.stage2(0, hs[mq.first]), cs, Hkv, Hq // Hkv)
        self.cache.write(i, hs[mk.first].unsqueeze(1), hs[mv.first].unsqueeze(1), pos)
        n = self.cache.host_len + 1
        K = L.qkv.stage2(1, self.cache.k[i][:B, :n])               # [B, n, Hkv*D]  (rebuilt)
        V = L.qkv.stage2(2, self.cache.v[i][:B, :n])
        posn = (self._slots[:n][None, :] - self.cache.pad[:B, None]).clamp_min(0)
        csn = self.cs_table[posn]                                   # [B, n, 2, D]
        K = K.view(B, n, Hkv, D)
        K = K * csn[:, :, :1] + _rotate_half(K) * csn[:, :, 1:]
        o = F.scaled_dot_product_attention(q, K.transpose(1, 2), V.view(B, n, Hkv, D).transpose(1, 2),
                                           attn_mask=mask)
        return o.reshape(B, Hq * D)

    def _mlp_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        L = self.layers[i]
        g, u = L.gate_up(self._norm(x, L.ln2))
        return x + L.down(self._act(g) * u)[0]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.norm))[0]

    def decode_body(self, tokens: torch.Tensor, live: int | None = None) -> torch.Tensor:
        """One decode step, all on device: tokens [B] -> logits [B, V]; appends to the cache."""
        ctx = self.step_context(tokens.shape[0], live)
        x = F.embedding(tokens, self.embed)
        for i in range(self.n_layers):
            x = self._attn_block(i, x, ctx)
            x = self._mlp_block(i, x)
        logits = self._head(x)
        self.cache.length.add_(1)
        return logits

    # ------------------------------------------------------------------ runner interface
    def prepare(self, B: int) -> float:
        """Capture graphs / compile the step for batch B (no-op without graphs). Returns seconds."""
        return self.graphs.prepare(B) if self.graphs is not None else 0.0

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the prompt [B, T]; fills cache slots [0, T). Returns logits [B, V] ([B, T, V] if all_logits)."""
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if B > self.cache.batch:
            raise CacheFullError(f"batch {B} exceeds EngineConfig.max_batch={self.cache.batch}")
        self.cache.check_room(T)
        pad = left_pad_counts(None if attention_mask is None else attention_mask.to(self.device), input_ids)
        self.cache.reset(pad)
        self._any_pad = self.cache.any_pad
        self._B = B
        Hq, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        slots = self._slots[:T]
        posn = (slots[None, :] - pad[:, None]).clamp_min(0)                    # [B, T]
        cs = self.cs_table[posn].reshape(B * T, 2, 1, 1, D)
        G = Hq // Hkv
        ok = (slots[None, :] <= slots[:, None])[None] & (slots[None, None, :] >= pad[:, None, None])
        ok = ok | torch.eye(T, dtype=torch.bool, device=self.device)[None]    # pad rows see themselves (no NaN)
        mask = self._additive_mask(ok)[:, None]
        x = F.embedding(input_ids.reshape(-1), self.embed)                     # [B*T, H]
        for i, L in enumerate(self.layers):
            h = self._norm(x, L.ln1)
            if self.config.kv == "rebuild":
                hs = L.qkv.stage1(h)
                mq, mk, mv = L.qkv.members
                q = self._rope(L.qkv.stage2(0, hs[mq.first]), cs, Hkv, G)
                self.cache.write(i, hs[mk.first].view(B, T, -1), hs[mv.first].view(B, T, -1), slots)
                k = self._rope(L.qkv.stage2(1, hs[mk.first]), cs, Hkv, 1)
                v = L.qkv.stage2(2, hs[mv.first])
            else:
                q, k, v = L.qkv(h)
                q, k = self._rope(q, cs, Hkv, G), self._rope(k, cs, Hkv, 1)
            q = q.view(B, T, Hq, D).transpose(1, 2)
            k = k.view(B, T, Hkv, D).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            self.prefill_kv(i, q, k, v, slots)
            o = prefill_attention(q, k, v, mask).transpose(1, 2).reshape(B * T, Hq * D)
            x = x + L.o(o)[0]
            x = self._mlp_block(i, x)
        if not all_logits:
            x = x.view(B, T, -1)[:, -1]
        logits = self._head(x)
        self.cache.length.fill_(T)
        self.cache.host_len = T
        return logits.view(B, T, -1) if all_logits else logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row: tokens [B] -> logits [B, V]."""
        if self._B is None:
            raise RuntimeError("call prefill() before step()")
        tokens = tokens.to(self.device)
        if tokens.shape != (self._B,):
            raise ValueError(f"step() expects tokens of shape ({self._B},), got {tuple(tokens.shape)}")
        c = self.cache
        c.check_room(c.host_len + 1)
        if self.graphs is not None:
            logits = self.graphs.step(tokens)
        else:
            logits = self.decode_body(tokens, live=c.host_len + 1)
        c.host_len += 1
        return logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask=None, **kw) -> GenerateOutput:
        """Greedy (default) or sampled generation; see :func:`run_generation` for keyword options.

        The whole request must fit the static cache: prompt + max_new_tokens - 1 <= max_seq_len,
        else ``CacheFullError`` is raised before any work (documented policy: no truncation).
        """
        T = input_ids.shape[1]
        self.cache.check_room(T + max_new_tokens - 1)
        out = run_generation(self, input_ids, max_new_tokens, attention_mask, **kw)
        out.info = {**self.report(), **out.info}
        return out
