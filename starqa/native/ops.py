"""starqa's compiled CPU kernels on torch tensors (starqa/native/_attend.c: exact attention;
starqa/native/_topk.c: top-k attention; starqa/native/_int4.c: int4 weights times a few rows;
starqa/native/_rows.c: RMSNorm, RoPE, SiLU·mul; starqa/native/_layer.c: a decoder layer's steps on
either side of its attention), built by `pip install` where a C compiler is found and bound
through ctypes by starqa.native.kernels. Without them, `available()` is False and
starqa.attention, starqa.topk.retrieval and starqa.models.decoder fall back to torch's and numpy's
code."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from starqa.native import kernels
from starqa.native.kernels import int4_fast, int8_gemm_fast

_library = kernels.library


def _kernel():
    library = _library()
    return None if library is None else library.starqa_attend


def available() -> bool:
    """Whether the compiled kernel is here."""
    return _kernel() is not None


def _fits(x: torch.Tensor) -> bool:
    """[H, N, D] on the CPU, bf16 or fp32, rows contiguous, D at most 256."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and x.shape[-1] <= 256)


def supports(key: torch.Tensor, value: torch.Tensor | None = None) -> bool:
    """Whether `attend` takes keys (and values) like these, [H, N, D]: CPU, bf16 or fp32,
    rows contiguous, D at most 256; values of the keys' shape and dtype."""
    return (_fits(key) and (value is None or _fits(value) and value.shape == key.shape
                            and value.dtype == key.dtype) and available())


def attend(q: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float,
           own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel behind starqa.attention.partial_parts (see there): q [H, R, D] over the
    keys of `parts`, buffers (key, value) [H, N_i, D] as `supports` says (heads may lie any
    distance apart), one dtype, in order: as one buffer of their N = sum N_i keys, read
    where each lies. Returns out [H, R, D] and lse [H, R], both fp32."""
    if not parts:
        return Layout([]).attend(q, None, None, scale, own)
    return Layout(parts[:-1]).attend(q, *parts[-1], scale, own)


class Layout:
    """Buffers for `attend` laid out once (a shard's blocks, which never change), with a
    slot after them for one that changes at every call (the question's own KV): a
    `kernels.KeyTable` over the tensors."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self.parts = list(parts)  # (kept alive while the table points at them)
        self._table = kernels.KeyTable([_buffer(key, value) for key, value in self.parts])
        self.keys = self._table.keys
        self.dtype = self.parts[0][0].dtype if self.parts else None

    def attend(self, q: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               scale: float, own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` over the laid-out buffers, then (key, value) [H, M, D] if given (the
        buffer that changes; `own` of its keys are the queries' own)."""
        heads, rows, dim = q.shape
        q = q.to(torch.float32).contiguous()
        out = q.new_empty(heads, rows, dim)
        lse = q.new_empty(heads, rows)
        dtype = self.dtype if self.dtype is not None else key.dtype if key is not None else None
        code = self._table.attend(dtype == torch.bfloat16, q.data_ptr(), heads, rows, dim,
                                  out.data_ptr(), lse.data_ptr(), scale,
                                  None if key is None else _buffer(key, value), own,
                                  torch.get_num_threads())
        if code:
            shapes = [tuple(k.shape) for k, _ in self.parts] + \
                ([tuple(key.shape)] if key is not None else [])
            raise (MemoryError() if code == 2 else ValueError(
                f"attention kernel: impossible shapes q {tuple(q.shape)}, keys {shapes}, "
                f"own {own}"))
        return out, lse

    def step_words(self) -> tuple[int, ...]:
        """The exact part of a layer's attention words for `decode_layers` (starqa/native/_step.c's
        E_*): the laid-out buffers and the addresses of the table's five arrays, whose slot
        after them the kernel fills with the own buffer at each call."""
        return (self._table.count - 1, *self._table.addresses)


def _buffer(key: torch.Tensor, value: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(key, value) [H, N, D] as a `kernels.KeyTable` buffer."""
    return key.data_ptr(), value.data_ptr(), key.shape[1], key.stride(0), value.stride(0)


def _address(x: torch.Tensor | None) -> int | None:
    """A tensor's address for a kernel's pointer argument; None (NULL) for none."""
    return None if x is None else x.data_ptr()


def supports_topk(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bool:
    """Whether `topk_attend` takes these key and value buffers (see there); no values: a
    table that only selects (`TopKTable.select`)."""
    buffers = list(keys) + list(values)
    return (available() and all(_fits(x) for x in buffers)
            and len({x.dtype for x in keys}) == 1 and len({x.dtype for x in values}) <= 1
            and len({x.shape[-1] for x in buffers}) == 1)


DROP_KEYS = 1  # TopKTable's drop (starqa/native/_topk.c's)


class TopKTable:
    """The arguments of the top-k kernel (starqa/native/_topk.c) that stay the same from call to
    call, laid out once: a layer's key and value buffers, its key order and ivf's lists.
    Built per call they cost ~15 small tensor operations a layer (SmolLM2's ivf decode at
    32K: ~27.8 against 25.6 ms/token); a shard keeps one table per layer
    (`retrieval.TopKShard`).

    keys: [(first position, [H, T, D])] the buffers holding positions 0 .. N-1 of every head,
    in order; key_map [H, N] int64: each position's row in the shard, key_at [H, N] int32
    each row's position (both None: the same). values: [(first row, [H, T, D])] the buffers
    holding the shard's value rows, or None: a table that only selects (`select`; the
    values are elsewhere, e.g. on a GPU). lists (ivf): (centroids [H, C, D], read in bf16,
    offsets [H, C + 1] int64, probes): position ranges, and how many of the nearest a row
    scans; None scans every position. drop: DROP_KEYS where the key buffers are clean private
    file mappings (flat's --kv-on-disk): the kernel drops their pages as its scan passes
    them (starqa/native/_topk.c), so a layer's keys are never resident at once; the same results.
    tail (ivf): (each list's mean value [H, C, D], read in bf16; each shard row's list [H,
    N] int32): the keys a row's union leaves out enter its softmax as their lists'
    estimate (`topk.tail_part`; starqa/native/_topk.c's `tail_rows`); None: they weigh nothing
    (top-k alone). The buffers must stay where they are while the table lives (it keeps
    them referenced)."""

    def __init__(self, keys: Sequence[tuple[int, torch.Tensor]],
                 values: Sequence[tuple[int, torch.Tensor]] | None,
                 key_map: torch.Tensor | None = None,
                 lists: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                 key_at: torch.Tensor | None = None, drop: int = 0,
                 tail: tuple[torch.Tensor, torch.Tensor] | None = None):
        n = keys[-1][0] + keys[-1][1].shape[1]
        self.drop = drop

        def table(buffers):
            return (torch.tensor([first for first, _ in buffers] + [n], dtype=torch.int64),
                    torch.tensor([x.data_ptr() for _, x in buffers], dtype=torch.int64),
                    torch.tensor([x.stride(0) for _, x in buffers], dtype=torch.int64))

        if key_map is not None:
            key_map = key_map.to(torch.int64).contiguous()
            if key_at is None:  # the inverse permutation
                key_at = torch.empty_like(key_map, dtype=torch.int32).scatter_(
                    1, key_map, torch.arange(n, dtype=torch.int32).expand_as(key_map).contiguous())
            key_at = key_at.to(torch.int32).contiguous()
        centroids = offsets = None
        self.lists, self.probes = 1, 1
        if lists is not None:
            centroids = lists[0].to(torch.bfloat16).contiguous()
            offsets = lists[1].to(torch.int64).contiguous()
            self.lists, self.probes = centroids.shape[1], lists[2]
        tail_values = tail_lists = None
        if tail is not None:
            tail_values, tail_lists = tail
            if (centroids is None or tail_values.shape != centroids.shape
                    or tail_lists.shape != (centroids.shape[0], n)):
                raise ValueError(f"top-k kernel: a tail {tuple(tail_values.shape)} with row "
                                 f"lists {tuple(tail_lists.shape)} for {n} keys needs ivf's "
                                 f"lists of that shape")
            tail_values = tail_values.to(torch.bfloat16).contiguous()
            tail_lists = tail_lists.to(torch.int32).contiguous()
        kstart, kptr, kstride = table(keys)
        self.selects_only = not values
        none = torch.zeros(1, dtype=torch.int64)
        vstart, vptr, vstride = table(values) if values else (none, none, none)
        # what the kernel reads through the addresses below, kept alive with the table
        self._keep = (keys, values, key_map, key_at, centroids, offsets, tail_values,
                      tail_lists, kstart, kptr, kstride, vstart, vptr, vstride)

        key_args = (n, len(keys), kstart.data_ptr(), kptr.data_ptr(), kstride.data_ptr(),
                    _address(key_map))
        list_args = (self.lists, _address(centroids), _address(offsets), self.probes)
        # every argument after q, heads, rows, tokens and dim, up to k
        self._middle = (*key_args, _address(key_at), len(values or ()), vstart.data_ptr(),
                        vptr.data_ptr(), vstride.data_ptr(), *list_args, _address(tail_values),
                        _address(tail_lists))
        self._select_args = (*key_args, *list_args)  # select's, after q, heads, rows and dim
        self._dtypes = (int(keys[0][1].dtype == torch.bfloat16),
                        int(bool(values) and values[0][1].dtype == torch.bfloat16))

    def step_words(self, k: int, skip: int, release: torch.Tensor | None = None
                   ) -> tuple[int, ...]:
        """The top-k part of a layer's attention words for `decode_layers` (starqa/native/_step.c's
        T_*): `attend`'s arguments that stay the same, then k, skip and drop, then
        `release` [P, 2] int64 (the caller keeps it alive): the (address, length) of the
        memory-mapped pages that the step releases after the layer's attention."""
        if self.selects_only:
            raise ValueError("top-k kernel: this table holds no values (it only selects)")
        if release is not None and (release.dtype != torch.int64 or release.dim() != 2
                                    or release.shape[1] != 2 or not release.is_contiguous()):
            raise ValueError(f"top-k kernel: release ranges {tuple(release.shape)} "
                             f"{release.dtype} (int64 [P, 2], contiguous)")
        pairs = (0, 0) if release is None else (release.data_ptr(), release.shape[0])
        return (*self._dtypes, *self._middle, k, skip, self.drop, *pairs)

    def attend(self, q: torch.Tensor, k: int, skip: int, scale: float,
               tokens: int | None = None,
               own: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k partial attention of every row of q [H, R, D] (the kernel's file says how).
        tokens: the forward's positions M, the rows being G blocks of M
        (`attention.fold_gqa`); the G rows of a position share their keys (None: M = R,
        nothing shared). Rows below `skip` (the sink) are never picked, and every row
        attends to them. own: the query host's own (keys, values) [H, L, D] (rows
        contiguous, bf16 or fp32), the last M of them this forward's, attended causally
        with the rest under one softmax. Returns out [H, R, D] and lse [H, R], fp32 (a row
        with no key: 0 and -inf)."""
        if self.selects_only:
            raise ValueError("top-k kernel: this table holds no values (it only selects)")
        heads, rows, dim = q.shape
        tokens = rows if tokens is None else tokens
        q = q.to(torch.float32).contiguous()
        out, lse = q.new_empty(heads, rows, dim), q.new_empty(heads, rows)
        own_args = (0, None, None, 0, 0)
        if own is not None:
            own_k, own_v = own
            if not (own_k.dtype == own_v.dtype and own_k.dtype in (torch.bfloat16, torch.float32)
                    and own_k.shape == own_v.shape and own_k.shape[0] == heads
                    and own_k.stride() == own_v.stride() and own_k.stride()[1:] == (dim, 1)
                    and own_k.shape[1] >= tokens and own_k.device.type == "cpu"):
                raise ValueError(f"top-k kernel: own keys {tuple(own_k.shape)} {own_k.dtype} "
                                 f"strides {own_k.stride()} for q {tuple(q.shape)}")
            own_args = (int(own_k.dtype == torch.bfloat16), own_k.data_ptr(), own_v.data_ptr(),
                        own_k.stride(0), own_k.shape[1] - tokens)
        code = _library().starqa_topk_attend(
            *self._dtypes, q.data_ptr(), heads, rows, tokens, dim,
            *self._middle, k, skip, *own_args, scale, out.data_ptr(), lse.data_ptr(),
            self.drop, torch.get_num_threads())
        if code:
            raise (MemoryError() if code == 2 else ValueError(
                f"top-k kernel: impossible arguments q {tuple(q.shape)}, k {k}, "
                f"{self.lists} lists, {self.probes} probes"))
        return out, lse

    def select(self, q: torch.Tensor, k: int, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys, as `attend` picks them, without attending: q [H, R, D]
        (any device; ranked on the CPU, where the keys are) → scores fp32 and shard rows
        int64 [H, R, k], in no set order: raw inner products q . key, -inf and -1 past the
        keys found. Rows below `skip` (the sink) are never picked. Each row is on its own
        (the GQA union is the caller's, `topk.share`)."""
        heads, rows, dim = q.shape
        q = q.to("cpu", torch.float32).contiguous()
        found = torch.empty(heads, rows, k, dtype=torch.int64)
        scores = torch.empty(heads, rows, k)
        code = _library().starqa_topk_select(
            self._dtypes[0], q.data_ptr(), heads, rows, dim, *self._select_args, k, skip,
            found.data_ptr(), scores.data_ptr(), torch.get_num_threads())
        if code:
            raise (MemoryError() if code == 2 else ValueError(
                f"top-k kernel: impossible arguments q {tuple(q.shape)}, k {k}, "
                f"{self.lists} lists, {self.probes} probes"))
        return scores, found


def topk_attend(q: torch.Tensor, keys: Sequence[tuple[int, torch.Tensor]],
                values: Sequence[tuple[int, torch.Tensor]], k: int, skip: int, scale: float,
                key_map: torch.Tensor | None = None,
                lists: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                tokens: int | None = None, key_at: torch.Tensor | None = None,
                own: tuple[torch.Tensor, torch.Tensor] | None = None,
                tail: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k partial attention of every row of q [H, R, D] over one layer of a shard: a
    `TopKTable` of these buffers, attended once (`supports_topk` says which buffers the
    kernel takes)."""
    return TopKTable(keys, values, key_map, lists, key_at, tail=tail).attend(
        q, k, skip, scale, tokens, own)


def int4_mm(x: torch.Tensor, tiles: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, CPU) times int4 weights [N, K] packed as `tiles` (uint8
    [N / 16, K / 32, 320], starqa/native/_int4.c says how) transposed: [M, N] in x's dtype, the
    activations quantised to 14 bits per group of 32. fast=False: the kernel's plain C path
    (the same sums; for tests)."""
    library = _library()
    n, k = tiles.shape[0] * 16, tiles.shape[1] * 32
    if (x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu"
            or x.dim() != 2 or x.shape[-1] != k):
        raise ValueError(f"int4 kernel: x {tuple(x.shape)} {x.dtype} against weights [{n}, {k}]")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], n)
    bf16 = int(x.dtype == torch.bfloat16)
    code = library.starqa_int4_mm(bf16, x.data_ptr(), x.shape[0], k, tiles.data_ptr(), n, bf16,
                                  y.data_ptr(), int(fast), torch.get_num_threads())
    if code:
        raise MemoryError() if code == 2 else ValueError(f"int4 kernel: shapes {n}x{k}")
    return y


def rows_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `rms_norm` and `rope_` take tensors of this device and dtype."""
    return available() and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] with `weight` [H] (starqa/native/_rows.c: transformers' roundings), both
    contiguous, of one dtype that `rows_supported` takes (the caller's to check: this runs
    once per norm of every token, and is kept lean: ~4 µs against torch's ~11)."""
    y = torch.empty_like(x)
    _library().starqa_rms_norm(x.dtype == torch.bfloat16, x.data_ptr(), x.shape[0], x.shape[1],
                               weight.data_ptr(), eps, y.data_ptr())
    return y


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on heads [0, heads) of x [M, H, D] with cos, sin [M, 1, D]
    (starqa/native/_rows.c), all contiguous, of one dtype that `rows_supported` takes, D even and
    at most 512; returns x[:, :heads]."""
    if _library().starqa_rope(x.dtype == torch.bfloat16, x.data_ptr(), x.shape[0],
                              x.shape[1] * x.shape[2], heads, x.shape[2], cos.data_ptr(),
                              sin.data_ptr()):
        raise ValueError(f"RoPE kernel: head size {x.shape[2]} (even, at most 512)")
    return x[:, :heads]


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [M, 1, D] in `dtype` (one `rows_supported` takes) for `positions` [M] and
    fp32 `inv_freq` [D / 2] (starqa/native/_rows.c: angles in fp32, libm's cos and sin)."""
    positions = positions.to(torch.int64).contiguous()
    inv_freq = inv_freq.to(torch.float32).contiguous()
    m, d = positions.shape[0], 2 * inv_freq.shape[0]
    cos, sin = (torch.empty(m, 1, d, dtype=dtype) for _ in range(2))
    _library().starqa_rope_table(dtype == torch.bfloat16, positions.data_ptr(), m,
                                 inv_freq.data_ptr(), d, cos.data_ptr(), sin.data_ptr())
    return cos, sin


def _check(code: int, what: str) -> None:
    if code:
        raise MemoryError() if code == 2 else ValueError(f"{what}: impossible shapes")


def layer_before(hidden: torch.Tensor, norm: torch.Tensor, eps: float, qkv: torch.Tensor,
                 bias: torch.Tensor | None, rotated: int, dim: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """A decoder layer before its attention (starqa/native/_layer.c): RMSNorm of hidden [M, H],
    times the int4 tiles `qkv` (+ bias), RoPE on the first `rotated` heads of D = dim;
    returns [M, N / dim, dim]. Every tensor contiguous, one dtype `rows_supported` takes
    (the caller's to check, as for `rms_norm`)."""
    m, h = hidden.shape
    n = qkv.shape[0] * 16
    if qkv.shape[1] * 32 != h or n % dim:
        raise ValueError(f"decoder layer: hidden {tuple(hidden.shape)} against qkv tiles "
                         f"{tuple(qkv.shape)} of heads of {dim}")
    y = hidden.new_empty(m, n // dim, dim)
    _check(_library().starqa_layer_before(
        hidden.dtype == torch.bfloat16, hidden.data_ptr(), m, h, norm.data_ptr(), eps,
        qkv.data_ptr(), n, _address(bias), rotated, dim, cos.data_ptr(), sin.data_ptr(),
        y.data_ptr(), torch.get_num_threads()), "decoder layer")
    return y


def layer_after(hidden: torch.Tensor, attn: torch.Tensor, out, norm: torch.Tensor, eps: float,
                gate_up, down) -> None:
    """A decoder layer after its attention (starqa/native/_layer.c), on hidden [M, H] in place:
    the output projection of attn [M, K] and its residual, RMSNorm, the MLP and its
    residual. out, gate_up, down: (int4 tiles, bias or None). Every tensor contiguous,
    one dtype `rows_supported` takes."""
    m, h = hidden.shape
    if (attn.shape[1] != out[0].shape[1] * 32 or out[0].shape[0] * 16 != h
            or gate_up[0].shape[1] * 32 != h or down[0].shape[0] * 16 != h
            or down[0].shape[1] * 32 != gate_up[0].shape[0] * 8):
        raise ValueError(f"decoder layer: hidden {tuple(hidden.shape)}, attention "
                         f"{tuple(attn.shape)} against tiles {tuple(out[0].shape)}, "
                         f"{tuple(gate_up[0].shape)}, {tuple(down[0].shape)}")
    _check(_library().starqa_layer_after(
        hidden.dtype == torch.bfloat16, hidden.data_ptr(), m, h, attn.data_ptr(),
        attn.shape[1], out[0].data_ptr(), _address(out[1]), norm.data_ptr(), eps,
        gate_up[0].data_ptr(), gate_up[0].shape[0] * 8, _address(gate_up[1]),
        down[0].data_ptr(), _address(down[1]), torch.get_num_threads()), "decoder layer")


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(g) · u for x [M, 2N] = [g ‖ u], contiguous, of a dtype `rows_supported` takes
    (starqa/native/_rows.c: torch's roundings, one exp of starqa's): [M, N]."""
    m, n = x.shape[0], x.shape[1] // 2
    y = x.new_empty(m, n)
    _library().starqa_silu_mul(x.dtype == torch.bfloat16, x.data_ptr(), m, n, y.data_ptr())
    return y


# starqa/native/_step.c's words of a layer, in its order: the model's (M_*); the attention's (A_*:
# kind, scale, own keys, own values, their capacity) followed by exact's (E_*) or top-k's
# (T_*); the kinds A_EXACT and A_TOPK.
MODEL_WORDS = ("bf16", "hidden", "heads", "kv_heads", "dim", "inner", "eps", "attn_norm",
               "qkv", "qkv_bias", "out", "out_bias", "mlp_norm", "gate_up", "gate_up_bias",
               "down", "down_bias")
STEP_EXACT, STEP_TOPK = 0, 1


def _word(value) -> int:
    """A word of a `decode_layers` array: a tensor's address (None: 0), a float's fp32 bits,
    an int."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, float):
        return int(torch.tensor(value, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF
    return int(value)


def step_words(layers: Sequence[Sequence], attention: bool = False) -> torch.Tensor | None:
    """[L, words] int64 for `decode_layers`: per layer its values in MODEL_WORDS order (or
    with attention, the attention's words as _step.c orders them); None where the compiled
    library is not here or lays its words out otherwise."""
    library = _library()
    if library is None:
        return None
    width = int(library.starqa_step_words(int(attention)))
    if not attention and width != len(MODEL_WORDS):
        return None
    words = torch.zeros(len(layers), width, dtype=torch.int64)
    for index, values in enumerate(layers):
        if len(values) > width:
            return None
        words[index, :len(values)] = torch.tensor([_word(v) for v in values],
                                                  dtype=torch.int64)
    return words


def decode_layers(model: torch.Tensor, attention: torch.Tensor, hidden: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, before: int, q_rows: torch.Tensor,
                  lse: torch.Tensor) -> None:
    """Every decoder layer of a forward in one call (starqa/native/_step.c), on hidden [M, H] in
    place: model and attention, `step_words`' arrays (their tensors alive and where they
    were); cos, sin [M, 1, D] (`rope_table`); before: the own keys written before this
    forward's; q_rows [L, Hkv, G * M, D] and lse [L, Hkv, G * M], fp32, contiguous: filled
    with each layer's folded query rows and their LSE."""
    layers, m = model.shape[0], hidden.shape[0]
    if (attention.shape[0] != layers or not hidden.is_contiguous() or q_rows.shape[0] != layers
            or q_rows.dtype != torch.float32 or lse.dtype != torch.float32
            or not q_rows.is_contiguous() or not lse.is_contiguous()):
        raise ValueError(f"decode step: {layers} layers against attention words "
                         f"{tuple(attention.shape)}, rows {tuple(q_rows.shape)}")
    _check(_library().starqa_decode_layers(
        layers, model.data_ptr(), attention.data_ptr(), hidden.data_ptr(), m, cos.data_ptr(),
        sin.data_ptr(), before, q_rows.data_ptr(), lse.data_ptr(), torch.get_num_threads()),
        "decode step")
