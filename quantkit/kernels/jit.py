"""Triton kernels over the packed layouts: dequantize, a GEMV for decode (few rows of x) and a tiled
GEMM for prefill. All three read the weight through one tile function, so a layout is described
once; the matmuls accumulate in float32 and never write W to memory.

A layout's buffers arrive as five pointers (w0..w4), a float and two ints (quantkit.qlinear's
kernel_args); FMT picks the layout at compile time. ORDER (the GEMV and dequantize): W's columns are
stored in another order, w4[k] the column that stored column k is (act-order read in plain group
order): x is read, and W written, through it.
"""
import triton
import triton.language as tl

GPTQ, NF4 = 0, 1


@triton.jit
def _stream(ptr, i, base, step, BITS: tl.constexpr, mask):
    """Value i of a GPTQ bit stream (32 values in BITS int32 words) whose words lie at base + word * step."""
    pos = (i % 32) * BITS
    word = (i // 32) * BITS + pos // 32
    off = (pos % 32).to(tl.uint32)
    v = tl.load(ptr + base + word * step, mask=mask, other=0).to(tl.uint32, bitcast=True) >> off
    if BITS == 3:  # values 10 and 21 of a run straddle two words
        spill = off > 29
        hi = tl.load(ptr + base + (word + 1) * step, mask=mask & spill, other=0).to(tl.uint32, bitcast=True)
        v = v | tl.where(spill, hi << ((32 - off) & 31), 0)
    return (v & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _zero_scale(w1, w2, g, n, i0, i1, N, BITS: tl.constexpr, mask):
    """GPTQ group g's zero code (stored plus i1, in BITS bits) and scale, for outputs n."""
    z = (_stream(w1, n, g * i0, 1, BITS, mask) + i1) & ((1 << BITS) - 1)
    return z, tl.load(w2 + g * N + n, mask=mask, other=0.0)


@triton.jit
def _float(q):
    """A code (0 <= q < 2^23) as float32 2^23 + q, by its bits: two of these subtract exactly, and
    no int-to-float conversion (a slow instruction on GPUs) is needed."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _words(ptr, k0, n, K, N, RS, NS, BITS: tl.constexpr, BK: tl.constexpr, PER: tl.constexpr, HIGH: tl.constexpr):
    """The codes of columns k0..k0+BK for outputs n [1, BN] as a [BK, BN] tile, from words of PER codes
    of BITS bits at ptr + row * RS + n * NS (row: word k // PER of an output), the first code in the
    low bits (GPTQ's int32 words) or, HIGH, in the high bits (bitsandbytes' bytes). Each word is
    loaded once and split by shifts (_stream loads it once per value)."""
    rows = k0 // PER + tl.arange(0, BK // PER)[:, None]
    words = tl.load(ptr + rows * RS + n * NS, mask=(rows * PER < K) & (n < N), other=0).to(tl.int32)
    j = tl.arange(0, PER)
    shifts = ((PER - 1 - j if HIGH else j) * BITS)[None, :, None]
    q = (words[:, None, :] >> shifts) & ((1 << BITS) - 1)  # [BK / PER, PER, BN]: value j of word r is column r * PER + j
    return tl.reshape(q, (BK, q.shape[2]))


@triton.jit
def _absmax(w1, w3, w4, fparam, j, i1, NESTED: tl.constexpr, mask):
    """The absmax of NF4 blocks j: stored, or with double quantization its uint8 code's value times
    the nested block's absmax, plus the offset."""
    if NESTED:
        code = tl.load(w1 + j, mask=mask, other=0).to(tl.int32)
        nested = j.to(tl.uint32) // i1.to(tl.uint32)  # unsigned: fewer instructions than a signed division
        a = tl.load(w4 + code, mask=mask, other=0.0) * tl.load(w3 + nested, mask=mask, other=0.0) + fparam
    else:
        a = tl.load(w1 + j, mask=mask, other=0.0)
    return a


@triton.jit
def _weight(w0, w1, w2, w3, w4, fparam, i0, i1, k, n, K, N, mask, k0,
            FMT: tl.constexpr, BITS: tl.constexpr, NESTED: tl.constexpr, GROUP: tl.constexpr,
            BK: tl.constexpr, WORDS: tl.constexpr):
    """W[n, k] in float32 for index tensors k and n (broadcast together), k0 the tile's first column.
    GPTQ: w0 qweight, w1 qzeros, w2 scales, w3 g_idx; i0 int32 words per qzeros row, i1 added to stored
    zeros. GROUP > 0: the tile lies in group k0 // GROUP (no act-order, groups whole tiles), so scales
    and zeros are read once per output, not per weight; GROUP 0: each column's group from g_idx.
    NF4: w0 nibbles, w1 absmax (uint8 codes if NESTED), w2 code table, w3 nested absmax, w4 nested table;
    i0 block size, i1 nested block size, fparam the offset of the nested absmax. WORDS: k is the
    [BK, 1] range from k0 and the codes come from _words; GPTQ: BITS divides 32; NF4: GROUP > 0, rows
    are whole blocks and the tile lies in one, so its absmax is read once per output."""
    if FMT == 0:
        if WORDS:
            q = _words(w0, k0, n, K, N, N, 1, BITS, BK, 32 // BITS, False)
        else:
            q = _stream(w0, k, n, N, BITS, mask)
        if GROUP > 0:
            g = k0 // GROUP
            gmask = n < N
        else:
            g = tl.load(w3 + k, mask=mask, other=0)
            gmask = mask
        z, s = _zero_scale(w1, w2, g, n, i0, i1, N, BITS, gmask)
        w = s.to(tl.float32) * (_float(q) - _float(z))
    elif WORDS:  # NF4, the tile in one block per output: bytes loaded once, the absmax once per output
        q = _words(w0, k0, n, K, N, 1, K // 2, 4, BK, 2, True)
        w = tl.load(w2 + q) * _absmax(w1, w3, w4, fparam, (n * K + k0) // i0, i1, NESTED, n < N)
    else:
        i = n * K + k
        byte = tl.load(w0 + i // 2, mask=mask, other=0).to(tl.int32)
        v = tl.load(w2 + tl.where(i % 2 == 0, byte >> 4, byte & 15), mask=mask, other=0.0)
        w = v * _absmax(w1, w3, w4, fparam, i // i0, i1, NESTED, mask)
    return w


@triton.jit
def _column(w4, k, mask, ORDER: tl.constexpr):
    """The column of W and x that stored column k is: w4[k] where the columns are stored in another order."""
    if ORDER:
        c = tl.load(w4 + k, mask=mask, other=0)
    else:
        c = k
    return c


@triton.jit
def _round(w, DTYPE: tl.constexpr):
    """float32 w in DTYPE, rounded to nearest even; bfloat16 by integer arithmetic, which the
    interpreter (whose cast truncates) and the GPU agree on."""
    if DTYPE == tl.bfloat16:
        b = w.to(tl.uint32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
        out = r.to(tl.bfloat16, bitcast=True)
    else:
        out = w.to(DTYPE)
    return out


@triton.jit
def dequantize_kernel(out, w0, w1, w2, w3, w4, fparam, i0, i1, N, K,
                      FMT: tl.constexpr, BITS: tl.constexpr, NESTED: tl.constexpr, GROUP: tl.constexpr,
                      ORDER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
    """A [BK, BN] tile of W (inputs by outputs, as the matmuls read it), stored in out [N, K] (in W's
    own column order)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)[None, :]
    k0 = tl.program_id(1) * BK
    k = k0 + tl.arange(0, BK)[:, None]
    mask = (n < N) & (k < K)
    w = _weight(w0, w1, w2, w3, w4, fparam, i0, i1, k, n, K, N, mask, k0, FMT, BITS, NESTED, GROUP, BK, WORDS)
    tl.store(out + n * K + _column(w4, k, k < K, ORDER), _round(w, out.dtype.element_ty), mask=mask)


@triton.jit
def gemv_kernel(x, y, part, count, w0, w1, w2, w3, w4, fparam, i0, i1, N, K, K_SPLIT,
                FMT: tl.constexpr, BITS: tl.constexpr, NESTED: tl.constexpr, GROUP: tl.constexpr,
                ORDER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, WORDS: tl.constexpr):
    """One row of x against BN outputs over one K_SPLIT slice of the inputs; with several slices
    the partial sums meet in _finish."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    start = tl.program_id(1) * K_SPLIT
    row = tl.program_id(2)
    if FMT == 0 and WORDS and GROUP > 0:
        acc = _gemv_words(x + row * K, w0, w1, w2, w4, i0, i1, n, start, K_SPLIT, K, N, BITS, GROUP, ORDER, BN, BK)
    elif FMT == 1 and WORDS:
        acc = _gemv_nf4(x + row * K, w0, w1, w2, w3, w4, fparam, i1, n, start, K_SPLIT, K, N, NESTED, GROUP, BN, BK)
    else:
        acc = tl.zeros((BN,), dtype=tl.float32)
        for step in range(0, tl.minimum(K_SPLIT, K - start), BK):  # the last slice ends at K
            k0 = start + step
            k = k0 + tl.arange(0, BK)
            xk = tl.load(x + row * K + _column(w4, k, k < K, ORDER), mask=k < K, other=0.0)
            mask = (k[:, None] < K) & (n[None, :] < N)
            w = _weight(w0, w1, w2, w3, w4, fparam, i0, i1, k[:, None], n[None, :], K, N, mask, k0,
                        FMT, BITS, NESTED, GROUP, BK, WORDS)
            acc += tl.sum(xk.to(tl.float32)[:, None] * w, axis=0)
    if SPLIT:
        CHUNK: tl.constexpr = 16  # slices added at a time by the last program: [16, BN] loads (as timed on the H100)
        _finish(y, part, count, acc, row * N + n, n < N, row * tl.num_programs(0) + tl.program_id(0),
                tl.program_id(1), tl.num_programs(1), tl.num_programs(2) * N, CHUNK)
    else:
        tl.store(y + row * N + n, _round(acc, y.dtype.element_ty), mask=n < N)


@triton.jit
def _finish(y, part, count, acc, offs, mask, tile, piece, pieces, size, CHUNK: tl.constexpr):
    """A split sum's end: acc (1D, for offs of y), the sum of slice `piece` of K, is stored at
    part[piece] ([pieces, size] float32); the slice of an output tile that finishes last (count[tile]
    counts them) adds all slices in order, CHUNK at a time, writes y rounded to its dtype and leaves
    the count 0 for the next call. One launch, no zeroed float32 y nor a cast after it, and the same
    sum on every run (atomic adds would land in any order)."""
    tl.store(part + piece * size + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's part stored before the count moves
    if tl.atomic_add(count + tile, 1, sem="acq_rel") == pieces - 1:
        total = tl.zeros_like(acc)
        for c in range(0, pieces, CHUNK):
            i = c + tl.arange(0, CHUNK)[:, None]
            total += tl.sum(tl.load(part + i * size + offs[None, :], mask=(i < pieces) & mask[None, :], other=0.0,
                                    cache_modifier=".cg"), axis=0)  # .cg: from L2, where the other programs wrote
        tl.store(y + offs, _round(total, y.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count + tile, 0, sem="relaxed")


@triton.jit
def _gemv_words(x, w0, w1, w2, w4, i0, i1, n, start, K_SPLIT, K, N, BITS: tl.constexpr, GROUP: tl.constexpr,
                ORDER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The GEMV's sum over one slice for GPTQ codes in whole words, each tile in one group: the tile of
    words taken apart one value position j at a time ([BK / PER, BN] each, no reshape), in three
    instructions a weight (a logic operation, a subtraction, a multiply-add). A code at bit P of a half
    word becomes the float 2^(23 - P) + q by its bits: the half word lies in the low mantissa bits
    under exponent bits that hold each such float's (0x4F000000), and one AND keeps the code's bits
    and its float's exponent. Less 2^(23 - P) + z, made so from the zero, that is q - z exactly (each
    product x (q - z) exact for float16 and bfloat16 x). The scale multiplies each output's sum over the
    tile once."""
    PER: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PER // 2
    ONES: tl.constexpr = (1 << BITS) - 1
    acc = tl.zeros((BK // PER, BN), dtype=tl.float32)
    end = tl.minimum(start + K_SPLIT, K)  # the last slice ends at K
    words, zq, s = _words_tile(w0, w1, w2, i0, i1, n, start, end, N, BITS, GROUP, BK)
    for k0 in range(start, end, BK):
        r = k0 // PER + tl.arange(0, BK // PER)  # word rows; K is whole words
        # the next tile's loads go out before this one's arithmetic: a program's steps overlap in memory
        next_words, next_zq, next_s = _words_tile(w0, w1, w2, i0, i1, n, k0 + BK, end, N, BITS, GROUP, BK)
        lo = (words & 0xFFFF) | 0x4F000000  # 0x4F: the exponent bits of 2^(23 - P) for every P (2, 4 and 8 bits)
        hi = ((words >> 16) & 0xFFFF) | 0x4F000000
        zs = (zq * (0xFFFF // ONES)) | 0x4F000000  # the zero code at every position of 16 bits
        part = tl.zeros((BK // PER, BN), dtype=tl.float32)
        for j in tl.static_range(PER):
            P = (j % HALF) * BITS
            keep = (ONES << P) | ((150 - P) << 23)  # the code and the exponent of 2^(23 - P)
            if j < HALF:
                q = lo & keep
            else:
                q = hi & keep
            zf = (zs & keep).to(tl.float32, bitcast=True)
            xk = tl.load(x + _column(w4, r * PER + j, r * PER < K, ORDER), mask=r * PER < K, other=0.0)
            part += xk.to(tl.float32)[:, None] * (q.to(tl.float32, bitcast=True) - zf[None, :])
        acc += part * s.to(tl.float32)[None, :]
        words, zq, s = next_words, next_zq, next_s
    return tl.sum(acc, axis=0)


@triton.jit
def _words_tile(w0, w1, w2, i0, i1, n, k0, end, N, BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr):
    """The [BK / PER, BN] words of the tile from column k0 (none from end on), its group's zero codes
    and scales."""
    PER: tl.constexpr = 32 // BITS
    r = k0 // PER + tl.arange(0, BK // PER)
    words = tl.load(w0 + r[:, None] * N + n[None, :], mask=(r[:, None] * PER < end) & (n[None, :] < N), other=0)
    zq, s = _zero_scale(w1, w2, k0 // GROUP, n, i0, i1, N, BITS, n < tl.where(k0 < end, N, 0))
    return words, zq, s


@triton.jit
def _gemv_nf4(x, w0, w1, w2, w3, w4, fparam, i1, n, start, K_SPLIT, K, N, NESTED: tl.constexpr, GROUP: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """The GEMV's sum over one slice for NF4/FP4 codes, each tile in one block (GROUP) per output: a
    [BN, BK / 2] tile of bytes, outputs by bytes, so that a thread loads consecutive bytes of an output
    as one vector and needs few values of x (one contiguous load, split into the two nibbles' columns).
    Each nibble's value comes from the 16-entry table held by the program (_lookup). The absmax, read
    once per tile, multiplies each output's sum over the tile once."""
    table = tl.load(w2 + tl.arange(0, 16))
    acc = tl.zeros((BN, BK // 2), dtype=tl.float32)
    for step in range(0, tl.minimum(K_SPLIT, K - start), BK):  # the last slice ends at K; K is whole tiles
        k0 = start + step
        r = k0 // 2 + tl.arange(0, BK // 2)  # bytes of a row
        b = tl.load(w0 + n[:, None] * (K // 2) + r[None, :], mask=n[:, None] < N, other=0).to(tl.int32)
        a = _absmax(w1, w3, w4, fparam, n * (K // GROUP) + k0 // GROUP, i1, NESTED, n < N)
        x0, x1 = tl.split(tl.reshape(tl.load(x + k0 + tl.arange(0, BK)).to(tl.float32), (BK // 2, 2)))
        # the high nibble is the first column
        acc += (x0[None, :] * _lookup(table, b >> 4) + x1[None, :] * _lookup(table, b & 15)) * a[:, None]
    return tl.sum(acc, axis=1)


@triton.jit
def _lookup(table, q):
    """table[q] for codes q (2D) by tl.gather from the program's copy of the table (in shared memory, where
    16 float32 entries lie in 16 banks and a warp's lookups never conflict), not a load from global
    memory per weight (an L1 gather and its 64-bit address each): 0.88-0.90 of the GEMV's time at the
    same tile on an H200. A 256-entry table of both nibbles' values, one lookup per byte, took fewer
    instructions but more time (benchmarks/RESULTS.md, the eighth GPU run)."""
    return tl.reshape(tl.gather(table, tl.reshape(q, (q.numel,)), 0), q.shape)


@triton.jit
def gemm_kernel(x, y, part, count, w0, w1, w2, w3, w4, fparam, i0, i1, M, N, K, K_SPLIT,
                FMT: tl.constexpr, BITS: tl.constexpr, NESTED: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                WORDS: tl.constexpr, SPLIT: tl.constexpr):
    """A BM x BN tile of y over one K_SPLIT slice of the inputs (slices meet in _finish). UPCAST:
    multiply in float32 (exact products of bfloat16 values), for the interpreter, whose dot cannot
    take bfloat16."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(0, tl.minimum(K_SPLIT, K - start), BK):  # the last slice ends at K
        k0 = start + step
        k = k0 + tl.arange(0, BK)
        a = tl.load(x + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        mask = (k[:, None] < K) & (n[None, :] < N)
        w = _weight(w0, w1, w2, w3, w4, fparam, i0, i1, k[:, None], n[None, :], K, N, mask, k0,
                    FMT, BITS, NESTED, GROUP, BK, WORDS)
        w = _round(w, a.dtype)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if SPLIT:  # _finish takes 1D sums
        CHUNK: tl.constexpr = (4096 + BM * BN - 1) // (BM * BN)  # slices added at a time: 4096 values at most, or one slice
        _finish(y, part, count, tl.reshape(acc, (BM * BN,)), tl.reshape(m[:, None] * N + n[None, :], (BM * BN,)),
                tl.reshape((m[:, None] < M) & (n[None, :] < N), (BM * BN,)), tl.program_id(0) * tl.num_programs(1)
                + tl.program_id(1), tl.program_id(2), tl.num_programs(2), M * N, CHUNK)
    else:  # as a 2D store: a reshape would cost a layout change through shared memory
        tl.store(y + m[:, None] * N + n[None, :], _round(acc, y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))
