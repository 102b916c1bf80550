"""KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): query-agnostic importance by context reconstruction.

After the prefill of a context ``c``, the model is asked to repeat it: the input "Repeat the previous
context" + ``c`` is run teacher-forced through the model ON TOP of the full prefill cache, and every
cached KV pair is scored by the largest attention any reconstruction query of its GQA group gives it.
A pair that no query needs to rebuild the context is redundant for any later question about it.

Long contexts are scored in chunks of ``chunk`` tokens (the paper's appendix, m = 2K): chunk ``t`` is
reconstructed by the prompt "Repeat the previous context starting with <the last 8 tokens of chunk
t-1>:" + ``c_t``; its queries are softmaxed over the keys of ``c_t`` in the cache plus the input's own
keys (causal among those), and the pairs of ``c_t`` take the max over the group's query heads and the
input's positions. The forward itself attends to the whole cache, as in normal decoding.

KVzip's non-uniform allocation ranks the scores of ALL layers and heads together
(:func:`lowrank_lib.eviction.budget.keep_counts` with ``mode="global"``); a head-wise budget needs a
ragged cache to be a real saving (:mod:`lowrank_lib.kv.methods.composed`).

Besides the max score, :meth:`KVzip.score_context` returns what the reconstruction queries saw: the
attention mass each pair received and the query Gram matrix per KV head (``sum q^T q``), the
statistics the composed cache's attention-aware low-rank tier is fitted with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ContextScores, Scorer


def _prompt_ids(tok, text: str) -> list[int]:
    """The reconstruction instruction as an assistant turn of the chat template when there is one.

    Without a tokenizer (the tiny random test models) a fixed id sequence stands in for the instruction:
    those models understand no instruction anyway, the scoring machinery is what is exercised."""
    if tok is None:
        return [1 + (7 * i + len(text)) % 200 for i in range(8)]
    if getattr(tok, "chat_template", None):
        s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                    tokenize=False)
        return tok("\n" + s, add_special_tokens=False).input_ids
    return tok(f"\n\n{text}\n", add_special_tokens=False).input_ids


@dataclass
class KVzip(Scorer):
    """Context-reconstruction scoring (see the module docstring). Model scope: scores need a forward."""

    chunk: int = 2048
    prompt: str = "Repeat the previous context exactly."
    cont_prompt: str = "Repeat the previous context starting with"
    tail: int = 8
    q_chunk: int = 256          # query rows per softmax block (memory bound, not a result knob)
    scope: ClassVar[str] = "model"
    forced_window: ClassVar[int | None] = 0
    allocation: ClassVar[str] = "global"

    def inputs(self, tok, ids: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """[(start, end, input ids [1, n_in])]: one reconstruction input per context chunk."""
        S = ids.shape[-1]
        out = []
        for s in range(0, S, self.chunk):
            e = min(S, s + self.chunk)
            if s == 0:
                head = _prompt_ids(tok, self.prompt)
            else:
                tail = "" if tok is None else tok.decode(ids[0, max(0, s - self.tail):s])
                head = _prompt_ids(tok, f'{self.cont_prompt} "{tail}":')
            x = torch.cat([torch.tensor([head], dtype=ids.dtype, device=ids.device), ids[:, s:e]], 1)
            out.append((s, e, x))
        return out

    @torch.no_grad()
    def score_prefill(self, prefill) -> ContextScores:
        """Scores of one unpadded sequence's prefill (:class:`lowrank_lib.kv.Prefill`, batch 1): its ``ids``,
        ``tokenizer`` and ``probe`` (a forward of the reconstruction input on top of the whole prefill, returning
        every layer's post-RoPE queries and the input's own keys)."""
        ids, keys = prefill.ids, prefill.keys
        if ids is None or prefill.probe is None:
            raise ValueError("KVzip scores by context reconstruction: the prefill needs its token ids and a probe "
                             "forward (both adapters give them)")
        if ids.shape[0] != 1:
            raise ValueError("KVzip.score_prefill scores one sequence (batch 1); the KV methods fit row by row")
        S, L = prefill.length, len(keys)
        B, H, _, d = keys[0].shape
        dev = keys[0].device
        score = [torch.zeros(B, H, S, device=dev) for _ in range(L)]
        mass = [torch.zeros(B, H, S, device=dev) for _ in range(L)]
        gram = [torch.zeros(B, H, d, d, device=dev) for _ in range(L)]
        n_q = 0
        for s, e, x in self.inputs(prefill.tokenizer, ids):
            n_q += x.shape[-1]
            for i, (q, k_own) in enumerate(prefill.probe(x)):
                mx, ms, g = self._chunk_scores(q, torch.cat([keys[i], k_own], 2), s, e, S, prefill.scaling)
                score[i][..., s:e] = torch.maximum(score[i][..., s:e], mx)
                mass[i][..., s:e] += ms
                gram[i] += g
        return ContextScores(score, mass, gram, n_q)

    def _chunk_scores(self, query, key, s, e, S, scaling):
        """query [B, Hq, n, d] (the input), key [B, H, S + n, d] (cache + input) -> max / mass over the chunk's
        keys [B, H, e - s] and the query Gram [B, H, d, d]."""
        B, Hq, n, d = query.shape
        H = key.shape[1]
        G = Hq // H
        kb = torch.cat([key[:, :, s:e], key[:, :, S:]], 2).float()      # chunk keys + the input's own keys
        m = e - s
        qg = query.float().view(B, H, G, n, d)
        mx = torch.zeros(B, H, m, device=query.device)
        ms = torch.zeros(B, H, m, device=query.device)
        own = torch.arange(n, device=query.device)
        for r in range(0, n, self.q_chunk):
            q = qg[:, :, :, r:r + self.q_chunk]                          # [B, H, G, c, d]
            logits = torch.einsum("bhgcd,bhkd->bhgck", q, kb) * scaling
            vis = own[None, :] <= own[r:r + self.q_chunk, None]           # causal among the input's keys
            logits[..., m:] = logits[..., m:].masked_fill(~vis, float("-inf"))
            p = torch.softmax(logits, -1)[..., :m]
            mx = torch.maximum(mx, p.amax(dim=(2, 3)))
            ms += p.sum(dim=(2, 3))
        g = torch.einsum("bhgnd,bhgne->bhde", qg, qg)
        return mx, ms, g
