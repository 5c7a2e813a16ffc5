/*
 * test_comm.c -- gdp_comm collectives, nccl-tests style: exactly representable
 * rank-dependent integers in every dtype, exact comparison, in place and out of place,
 * contiguous and strided tensors, equal and unequal (zero-row) all-to-all splits,
 * sub-groups, agreement on every rank, byte counters, MPI errors as statuses.
 *
 * Run alone (the size-1 path: gdp_comm_world is a non-MPI size-1 communicator) and under
 * `mpirun -np 2` / `-np 4` (ctest labels cpu and mpi).  Every rank runs every check;
 * failing CHECKs do not stop a rank, so the ranks stay in step and nothing hangs.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

static gdp_ctx *ctx;
static int R, N; /* world rank and size */

static const gdp_dtype all_dtypes[] = {GDP_DTYPE_F64, GDP_DTYPE_F32, GDP_DTYPE_BF16,
                                       GDP_DTYPE_I32, GDP_DTYPE_I64};
enum { NDTYPES = sizeof all_dtypes / sizeof all_dtypes[0] };

/* An integer code as a value exactly representable in dt (bf16 holds integers up to
 * 256 exactly, so its codes are folded into [-119, 119]; the expected values are
 * folded the same way, so comparisons stay exact). */
static double val(gdp_dtype dt, int64_t code) {
  if (dt == GDP_DTYPE_BF16) return (double)(((code % 239) + 239) % 239 - 119);
  return (double)code;
}

static gdp_tensor *from_f64(gdp_dtype dt, int nd, const int64_t *shape, const double *v) {
  return tu_tensor_from_f64(ctx, dt, nd, shape, v);
}

static double *to_f64(const gdp_tensor *t) {
  int64_t n = gdp_tensor_numel(t);
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, v, (size_t)n * sizeof *v));
  return v;
}

/* Exact comparison of t with want; reports the first difference. */
static void expect_values(const char *what, const gdp_tensor *t, const double *want, int64_t n) {
  CHECK(gdp_tensor_numel(t) == n, "%s: %" PRId64 " elements, expected %" PRId64 " (rank %d/%d)",
        what, gdp_tensor_numel(t), n, R, N);
  if (gdp_tensor_numel(t) != n) return;
  double *got = to_f64(t);
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (got[i] != want[i]) bad = i;
  CHECK(bad < 0, "%s: element %" PRId64 " is %.17g, expected %.17g (rank %d/%d, %s)", what, bad,
        bad >= 0 ? got[bad] : 0.0, bad >= 0 ? want[bad] : 0.0, R, N,
        gdp_dtype_name(gdp_tensor_dtype(t)));
  free(got);
}

static void expect_counters(const char *what, gdp_comm *c, int64_t sent, int64_t received,
                            int64_t sent_all, int64_t received_all) {
  int64_t s = gdp_comm_bytes_sent(c), r = gdp_comm_bytes_received(c);
  int64_t sa = gdp_comm_bytes_sent_incl_self(c), ra = gdp_comm_bytes_received_incl_self(c);
  CHECK(s == sent && r == received && sa == sent_all && ra == received_all,
        "%s: counters sent %" PRId64 " received %" PRId64 " (incl. self %" PRId64 ", %" PRId64
        "), expected %" PRId64 " %" PRId64 " (%" PRId64 ", %" PRId64 ") (rank %d/%d)",
        what, s, r, sa, ra, sent, received, sent_all, received_all, R, N);
}

/* ------------------------------------------------------------------ allgather */

/* code of element i of rank r's input */
static int64_t ag_code(int r, int64_t i) { return 100003 * (int64_t)r + 7 * i - 50; }

static void check_allgather(gdp_comm *c, gdp_dtype dt, int nd, const int64_t *shape, int mode) {
  /* mode 0: out of place; 1: in place (in = out[rank]); 2: strided in and out;
   * 3: in is another rank's block of out (overlap, not in place) */
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  double *mine = malloc((size_t)(n ? n : 1) * sizeof *mine);
  double *want = malloc((size_t)(size * n > 0 ? size * n : 1) * sizeof *want);
  for (int64_t i = 0; i < n; i++) mine[i] = val(dt, ag_code(rank, i));
  for (int r = 0; r < size; r++)
    for (int64_t i = 0; i < n; i++) want[r * n + i] = val(dt, ag_code(r, i));
  int64_t oshape[GDP_MAX_DIMS + 1] = {size};
  for (int i = 0; i < nd; i++) oshape[i + 1] = shape[i];
  char what[128];
  snprintf(what, sizeof what, "allgather %s nd %d mode %d size %d", gdp_dtype_name(dt), nd, mode, size);

  gdp_tensor *out = NULL, *in = NULL, *base = NULL, *tmp = NULL;
  if (mode == 0 || mode == 1 || mode == 3) {
    CHECK_OK(gdp_tensor_zeros(ctx, dt, nd + 1, oshape, &out));
    if (mode == 0) {
      in = from_f64(dt, nd, shape, mine);
    } else {
      int blk = mode == 1 ? rank : (rank + 1) % size;
      CHECK_OK(gdp_tensor_select(out, 0, blk, &in));
      tmp = from_f64(dt, nd, shape, mine);
      CHECK_OK(gdp_tensor_copy(NULL, in, tmp));
    }
  } else {
    /* in: the transpose of a contiguous [shape reversed] tensor's transpose... simply a
     * strided view: take every other element of a tensor twice as long in dim 0 */
    int64_t bshape[GDP_MAX_DIMS + 1];
    for (int i = 0; i < nd; i++) bshape[i] = shape[i];
    bshape[0] = 2 * shape[0];
    CHECK_OK(gdp_tensor_zeros(ctx, dt, nd, bshape, &base));
    gdp_tensor *v = NULL;
    int64_t vshape[GDP_MAX_DIMS + 1] = {shape[0], 2};
    for (int i = 1; i < nd; i++) vshape[i + 1] = shape[i];
    CHECK_OK(gdp_tensor_view(base, nd + 1, vshape, &v));
    CHECK_OK(gdp_tensor_select(v, 1, 1, &in));
    gdp_tensor_free(v);
    tmp = from_f64(dt, nd, shape, mine);
    CHECK_OK(gdp_tensor_copy(NULL, in, tmp));
    CHECK(!gdp_tensor_is_contiguous(in) || n == 0 || shape[0] == 1, "%s: in should be strided", what);
    /* out: a permuted view of a contiguous [*shape, size] tensor */
    gdp_tensor *ob = NULL;
    int64_t obshape[GDP_MAX_DIMS + 1];
    for (int i = 0; i < nd; i++) obshape[i] = shape[i];
    obshape[nd] = size;
    CHECK_OK(gdp_tensor_zeros(ctx, dt, nd + 1, obshape, &ob));
    int perm[GDP_MAX_DIMS + 1] = {nd};
    for (int i = 0; i < nd; i++) perm[i + 1] = i;
    CHECK_OK(gdp_tensor_permute(ob, nd + 1, perm, &out));
    gdp_tensor_free(ob);
  }
  if (in && out) {
    CHECK_OK(gdp_comm_allgather(c, out, in));
    expect_values(what, out, want, size * n);
  }
  gdp_tensor_free(in);
  gdp_tensor_free(out);
  gdp_tensor_free(base);
  gdp_tensor_free(tmp);
  free(mine);
  free(want);
}

static void test_allgather(gdp_comm *c) {
  static const int64_t s1[] = {5}, s2[] = {3, 7}, s3[] = {2, 3, 4}, s0[] = {0, 3};
  for (int d = 0; d < NDTYPES; d++) {
    for (int mode = 0; mode < 4; mode++) {
      check_allgather(c, all_dtypes[d], 1, s1, mode);
      check_allgather(c, all_dtypes[d], 2, s2, mode);
      check_allgather(c, all_dtypes[d], 3, s3, mode);
    }
    check_allgather(c, all_dtypes[d], 0, NULL, 0); /* 0-dim -> [size] */
    check_allgather(c, all_dtypes[d], 2, s0, 0);   /* empty blocks */
  }
}

/* ------------------------------------------------------------------ all-to-all */

/* code of row k (of the block going from src to dst), column col */
static int64_t a2a_code(int src, int dst, int64_t k, int64_t col) {
  return 100000 * (int64_t)src + 1000 * (int64_t)dst + 10 * k + col;
}

/* send_rows of rank r to rank j (some zero) */
static int64_t uneven_rows(int r, int j, int variant) {
  switch (variant) {
    case 0: return (r + 2 * j) % 3;     /* 0, 1 or 2 rows, zeros included */
    case 1: return 0;                   /* nothing at all */
    case 2: return r == j ? 3 : 0;      /* only to itself */
    default: return (int64_t)(j == 0) * (r + 1); /* everything to rank 0 (gather-like) */
  }
}

/* mode 0: out of place; 1: in place (out == in, equal split only); 2: strided in */
static void check_alltoallv(gdp_comm *c, gdp_dtype dt, int variant, int equal, int mode,
                            int64_t cols) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  int64_t *send_rows = malloc((size_t)size * sizeof *send_rows);
  int64_t *recv_rows = malloc((size_t)size * sizeof *recv_rows);
  int64_t in_rows = 0, out_rows = 0;
  for (int j = 0; j < size; j++) {
    send_rows[j] = equal ? 2 : uneven_rows(rank, j, variant);
    recv_rows[j] = equal ? 2 : uneven_rows(j, rank, variant);
    in_rows += send_rows[j];
    out_rows += recv_rows[j];
  }
  double *in_v = malloc((size_t)(in_rows * cols + 1) * sizeof *in_v);
  double *want = malloc((size_t)(out_rows * cols + 1) * sizeof *want);
  int64_t row = 0;
  for (int j = 0; j < size; j++)
    for (int64_t k = 0; k < send_rows[j]; k++, row++)
      for (int64_t col = 0; col < cols; col++) in_v[row * cols + col] = val(dt, a2a_code(rank, j, k, col));
  row = 0;
  for (int j = 0; j < size; j++)
    for (int64_t k = 0; k < recv_rows[j]; k++, row++)
      for (int64_t col = 0; col < cols; col++) want[row * cols + col] = val(dt, a2a_code(j, rank, k, col));
  char what[128];
  snprintf(what, sizeof what, "all-to-all %s %s variant %d mode %d cols %" PRId64 " size %d",
           equal ? "equal" : "unequal", gdp_dtype_name(dt), variant, mode, cols, size);

  int64_t ishape[2] = {in_rows, cols}, oshape[2] = {out_rows, cols};
  gdp_tensor *in = NULL, *out = NULL, *base = NULL, *tmp = NULL;
  if (mode == 2) {
    int64_t bshape[2] = {cols, in_rows};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 2, bshape, &base));
    CHECK_OK(gdp_tensor_transpose(base, 0, 1, &in));
    tmp = from_f64(dt, 2, ishape, in_v);
    CHECK_OK(gdp_tensor_copy(NULL, in, tmp));
  } else {
    in = from_f64(dt, 2, ishape, in_v);
  }
  if (mode == 1) out = gdp_tensor_retain(in);
  else CHECK_OK(gdp_tensor_zeros(ctx, dt, 2, oshape, &out));
  if (equal) CHECK_OK(gdp_comm_alltoall(c, out, in));
  else CHECK_OK(gdp_comm_alltoallv(c, out, recv_rows, in, send_rows));
  expect_values(what, out, want, out_rows * cols);

  gdp_tensor_free(in);
  gdp_tensor_free(out);
  gdp_tensor_free(base);
  gdp_tensor_free(tmp);
  free(in_v);
  free(want);
  free(send_rows);
  free(recv_rows);
}

static void test_alltoall(gdp_comm *c) {
  for (int d = 0; d < NDTYPES; d++) {
    for (int mode = 0; mode < 3; mode++) check_alltoallv(c, all_dtypes[d], 0, 1, mode, 3);
    for (int variant = 0; variant < 4; variant++) {
      check_alltoallv(c, all_dtypes[d], variant, 0, 0, 3);
      check_alltoallv(c, all_dtypes[d], variant, 0, 2, 5);
    }
    check_alltoallv(c, all_dtypes[d], 0, 0, 0, 1);
  }
  /* rows with more dims: [rows, 2, 3], unequal split */
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  int64_t *sr = malloc((size_t)size * sizeof *sr), *rr = malloc((size_t)size * sizeof *rr);
  int64_t in_rows = 0, out_rows = 0;
  for (int j = 0; j < size; j++) {
    in_rows += sr[j] = uneven_rows(rank, j, 0);
    out_rows += rr[j] = uneven_rows(j, rank, 0);
  }
  int64_t ishape[3] = {in_rows, 2, 3}, oshape[3] = {out_rows, 2, 3};
  double *iv = malloc((size_t)(in_rows * 6 + 1) * sizeof *iv), *want = malloc((size_t)(out_rows * 6 + 1) * sizeof *want);
  int64_t row = 0;
  for (int j = 0; j < size; j++)
    for (int64_t k = 0; k < sr[j]; k++, row++)
      for (int e = 0; e < 6; e++) iv[row * 6 + e] = (double)a2a_code(rank, j, k, e);
  row = 0;
  for (int j = 0; j < size; j++)
    for (int64_t k = 0; k < rr[j]; k++, row++)
      for (int e = 0; e < 6; e++) want[row * 6 + e] = (double)a2a_code(j, rank, k, e);
  gdp_tensor *in = from_f64(GDP_DTYPE_F64, 3, ishape, iv), *out = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, oshape, &out));
  CHECK_OK(gdp_comm_alltoallv(c, out, rr, in, sr));
  expect_values("all-to-all [rows, 2, 3]", out, want, out_rows * 6);
  gdp_tensor_free(in);
  gdp_tensor_free(out);
  free(iv);
  free(want);
  free(sr);
  free(rr);
}

/* ------------------------------------------------------------------ allreduce, broadcast */

static int64_t ar_code(int r, int64_t i) { return ((int64_t)(r * 31 + i * 17) % 61) - 30; }

/* bf16: integers of both parities up to 241 in magnitude (exact), whose sums above 256
 * are not all representable, so the result shows that the sum is rounded once. */
static double ar_value(gdp_dtype dt, int r, int64_t i) {
  if (dt == GDP_DTYPE_BF16) return (double)(8 * ar_code(r, i) + (r + i) % 2);
  return (double)(1000 * ar_code(r, i));
}

static double rounded(gdp_dtype dt, double x) {
  return dt == GDP_DTYPE_BF16 ? (double)gdp_f32_from_bf16(gdp_bf16_from_f32((float)x)) : x;
}

static void check_allreduce(gdp_comm *c, gdp_dtype dt, gdp_reduce_op op, int strided, int64_t n) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  double *mine = malloc((size_t)(n + 1) * sizeof *mine), *want = malloc((size_t)(n + 1) * sizeof *want);
  for (int64_t i = 0; i < n; i++) {
    mine[i] = ar_value(dt, rank, i);
    double acc = ar_value(dt, 0, i);
    for (int r = 1; r < size; r++) {
      double x = ar_value(dt, r, i);
      acc = op == GDP_REDUCE_OP_SUM ? acc + x : op == GDP_REDUCE_OP_MAX ? (x > acc ? x : acc)
                                                                        : (x < acc ? x : acc);
    }
    want[i] = rounded(dt, acc);
  }
  char what[128];
  snprintf(what, sizeof what, "allreduce %s %s%s n %" PRId64 " size %d", gdp_reduce_op_name(op),
           gdp_dtype_name(dt), strided ? " strided" : "", n, size);
  int64_t shape[1] = {n};
  gdp_tensor *t = NULL, *base = NULL, *tmp = from_f64(dt, 1, shape, mine);
  if (strided) {
    int64_t bshape[2] = {n, 2};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 2, bshape, &base));
    CHECK_OK(gdp_tensor_select(base, 1, 0, &t));
    CHECK_OK(gdp_tensor_copy(NULL, t, tmp));
  } else {
    t = gdp_tensor_retain(tmp);
  }
  CHECK_OK(gdp_comm_allreduce(c, t, op));
  expect_values(what, t, want, n);
  if (strided) { /* the other column is untouched */
    gdp_tensor *other = NULL;
    CHECK_OK(gdp_tensor_select(base, 1, 1, &other));
    double mx = -1;
    CHECK_OK(gdp_tensor_max_abs(other, &mx));
    CHECK(mx == 0, "%s: wrote outside the strided view (max |other| %g)", what, mx);
    gdp_tensor_free(other);
  }
  gdp_tensor_free(t);
  gdp_tensor_free(tmp);
  gdp_tensor_free(base);
  free(mine);
  free(want);
}

static void check_broadcast(gdp_comm *c, gdp_dtype dt, int root, int strided) {
  int rank = gdp_comm_rank(c);
  enum { n = 11 };
  double mine[n], want[n];
  for (int i = 0; i < n; i++) {
    mine[i] = val(dt, ag_code(rank, i));
    want[i] = val(dt, ag_code(root, i));
  }
  int64_t shape[1] = {n};
  gdp_tensor *t = NULL, *base = NULL, *tmp = from_f64(dt, 1, shape, mine);
  if (strided) {
    int64_t bshape[2] = {n, 3};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 2, bshape, &base));
    CHECK_OK(gdp_tensor_select(base, 1, 2, &t));
    CHECK_OK(gdp_tensor_copy(NULL, t, tmp));
  } else {
    t = gdp_tensor_retain(tmp);
  }
  CHECK_OK(gdp_comm_broadcast(c, t, root));
  char what[96];
  snprintf(what, sizeof what, "broadcast %s root %d%s", gdp_dtype_name(dt), root, strided ? " strided" : "");
  expect_values(what, t, want, n);
  gdp_tensor_free(t);
  gdp_tensor_free(tmp);
  gdp_tensor_free(base);
}

static void test_allreduce_broadcast(gdp_comm *c) {
  static const gdp_reduce_op ops[] = {GDP_REDUCE_OP_SUM, GDP_REDUCE_OP_MAX, GDP_REDUCE_OP_MIN};
  for (int d = 0; d < NDTYPES; d++) {
    for (int o = 0; o < 3; o++) {
      check_allreduce(c, all_dtypes[d], ops[o], 0, 13);
      check_allreduce(c, all_dtypes[d], ops[o], 1, 13);
    }
    check_allreduce(c, all_dtypes[d], GDP_REDUCE_OP_SUM, 0, 0);
    for (int root = 0; root < gdp_comm_size(c); root++) {
      check_broadcast(c, all_dtypes[d], root, 0);
      check_broadcast(c, all_dtypes[d], root, 1);
    }
  }
}

/* ------------------------------------------------------------------ point to point */

static int64_t msg_len(int r) { return 3 + 4 * (int64_t)r; } /* rank r's message length */

static void test_p2p(gdp_comm *c) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  double sv[64], want[64];
  for (int64_t i = 0; i < msg_len(rank); i++) sv[i] = (double)ag_code(rank, i);
  for (int64_t i = 0; i < msg_len(prev); i++) want[i] = (double)ag_code(prev, i);
  int64_t sshape[1] = {msg_len(rank)}, rshape[1] = {msg_len(prev)};

  /* sendrecv around the ring, unequal sizes */
  gdp_tensor *s = from_f64(GDP_DTYPE_F64, 1, sshape, sv), *r = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, rshape, &r));
  CHECK_OK(gdp_comm_sendrecv(c, s, next, r, prev, 7));
  expect_values("sendrecv ring", r, want, msg_len(prev));

  /* a chain: the ends have no partner on one side (-1) */
  gdp_tensor *r2 = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, rshape, &r2));
  int dst = rank + 1 < size ? rank + 1 : -1, src = rank > 0 ? rank - 1 : -1;
  CHECK_OK(gdp_comm_sendrecv(c, s, dst, src >= 0 ? r2 : NULL, src, 8));
  if (src >= 0) expect_values("sendrecv chain", r2, want, msg_len(prev));

  /* blocking send/recv around the ring: even ranks send first */
  if (size > 1 && gdp_comm_is_mpi(c)) {
    gdp_tensor *r3 = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, rshape, &r3));
    if (rank % 2 == 0) {
      CHECK_OK(gdp_comm_send(c, s, next, 3));
      CHECK_OK(gdp_comm_recv(c, r3, prev, 3));
    } else {
      CHECK_OK(gdp_comm_recv(c, r3, prev, 3));
      CHECK_OK(gdp_comm_send(c, s, next, 3));
    }
    expect_values("send/recv ring", r3, want, msg_len(prev));
    gdp_tensor_free(r3);
  }
  gdp_tensor_free(s);
  gdp_tensor_free(r);
  gdp_tensor_free(r2);
}

/* ------------------------------------------------------------------ sub-groups */

static void test_split(gdp_comm *world) {
  gdp_comm *half = NULL, *rev = NULL, *none = NULL;
  /* even and odd ranks */
  CHECK_OK(gdp_comm_split(world, R % 2, R, &half));
  int want_size = N / 2 + (R % 2 == 0 ? N % 2 : 0);
  CHECK(half && gdp_comm_size(half) == want_size && gdp_comm_rank(half) == R / 2,
        "split even/odd: rank %d size %d, expected %d of %d (world rank %d)", gdp_comm_rank(half),
        gdp_comm_size(half), R / 2, want_size, R);
  if (half) {
    /* allgather of world ranks inside the group */
    int64_t one[1] = {1};
    double me = R, *want = malloc((size_t)want_size * sizeof *want);
    for (int i = 0; i < want_size; i++) want[i] = R % 2 + 2 * i;
    gdp_tensor *in = from_f64(GDP_DTYPE_I64, 0, one, &me), *out = NULL;
    int64_t oshape[1] = {want_size};
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I64, 1, oshape, &out));
    CHECK_OK(gdp_comm_allgather(half, out, in));
    expect_values("allgather in the even/odd group", out, want, want_size);
    /* allreduce sum of world ranks inside the group */
    double sum = 0;
    for (int i = 0; i < want_size; i++) sum += want[i];
    gdp_tensor *t = from_f64(GDP_DTYPE_F64, 1, one, &me);
    CHECK_OK(gdp_comm_allreduce(half, t, GDP_REDUCE_OP_SUM));
    expect_values("allreduce in the even/odd group", t, &sum, 1);
    /* the group's own collectives */
    test_allreduce_broadcast(half);
    test_alltoall(half);
    gdp_tensor_free(in);
    gdp_tensor_free(out);
    gdp_tensor_free(t);
    free(want);
  }
  /* reversed order by key */
  CHECK_OK(gdp_comm_split(world, 0, -R, &rev));
  CHECK(rev && gdp_comm_rank(rev) == N - 1 - R && gdp_comm_size(rev) == N,
        "split by key -rank: rank %d, expected %d", gdp_comm_rank(rev), N - 1 - R);
  if (rev) test_p2p(rev);
  /* a negative color leaves this rank out */
  CHECK_OK(gdp_comm_split(world, R == 0 ? -1 : 1, 0, &none));
  CHECK((R == 0) == (none == NULL), "split with color -1: rank %d got %p", R, (void *)none);
  if (none) CHECK(gdp_comm_size(none) == N - 1, "split without rank 0: size %d", gdp_comm_size(none));
  gdp_comm_free(none);
  gdp_comm_free(rev);
  gdp_comm_free(half);
}

/* ------------------------------------------------------------------ agreement */

static void test_agree(gdp_comm *c) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  CHECK_OK(gdp_comm_agree_status(c, GDP_OK, "unused"));
  /* one failing rank (the last): every rank sees its status and message */
  int bad = size - 1;
  char msg[64];
  snprintf(msg, sizeof msg, "bad input on rank %d", rank);
  gdp_status st = gdp_comm_agree_status(c, rank == bad ? GDP_ERR_SHAPE : GDP_OK, msg);
  CHECK(st == GDP_ERR_SHAPE, "agree_status: rank %d got %s, expected GDP_ERR_SHAPE", rank, gdp_status_name(st));
  char needle[64];
  snprintf(needle, sizeof needle, "bad input on rank %d", bad);
  CHECK(strstr(gdp_last_error(), needle) != NULL, "agree_status message lacks \"%s\": %s", needle, gdp_last_error());
  snprintf(needle, sizeof needle, "ranks %d)", bad);
  CHECK(strstr(gdp_last_error(), needle) != NULL, "agree_status message lacks \"%s\": %s", needle, gdp_last_error());
  /* several failing ranks with different statuses: the lowest failing rank's wins */
  if (size >= 2) {
    st = gdp_comm_agree_status(c, rank % 2 ? GDP_ERR_DTYPE : rank == 0 ? GDP_OK : GDP_ERR_IO, NULL);
    CHECK(st == GDP_ERR_DTYPE, "agree_status (odd ranks fail): rank %d got %s", rank, gdp_status_name(st));
    CHECK(strstr(gdp_last_error(), "rank 1: GDP_ERR_DTYPE") != NULL, "agree_status message: %s", gdp_last_error());
  }

  int64_t v[3] = {4, 5, 6};
  CHECK_OK(gdp_comm_agree_values(c, "config", v, 3));
  CHECK_OK(gdp_comm_agree_values(c, "nothing", NULL, 0));
  if (size >= 2) {
    int64_t w[3] = {4, 5, rank == size - 1 ? 7 : 6};
    st = gdp_comm_agree_values(c, "config", w, 3);
    CHECK(st == GDP_ERR_INVALID_ARG, "agree_values (last rank differs): rank %d got %s", rank, gdp_status_name(st));
    snprintf(needle, sizeof needle, "rank %d: [4, 5, 7] (first difference at index 2)", size - 1);
    CHECK(strstr(gdp_last_error(), needle) && strstr(gdp_last_error(), "config differ"),
          "agree_values message lacks \"%s\": %s", needle, gdp_last_error());
    /* different counts: checked first, on every rank */
    st = gdp_comm_agree_values(c, "shape", v, rank == 0 ? 2 : 3);
    CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "different or invalid numbers"),
          "agree_values (counts differ): rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
    /* NULL values on one rank */
    st = gdp_comm_agree_values(c, "shape", rank == 1 ? NULL : v, 3);
    CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "values NULL"),
          "agree_values (NULL on rank 1): rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  }
  st = gdp_comm_agree_values(c, "shape", v, -1);
  CHECK(st == GDP_ERR_INVALID_ARG, "agree_values n = -1: got %s", gdp_status_name(st));
  CHECK_OK(gdp_comm_barrier(c));
}

/* ------------------------------------------------------------------ byte counters */

static void test_counters(gdp_comm *c) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  gdp_comm_reset_counters(c);
  expect_counters("after reset", c, 0, 0, 0, 0);
  int64_t shape[2] = {3, 5}, oshape[3] = {size, 3, 5};
  gdp_tensor *in = NULL, *out = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, shape, &in));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 3, oshape, &out));
  int64_t S = 15 * 4;
  CHECK_OK(gdp_comm_allgather(c, out, in));
  expect_counters("allgather", c, (size - 1) * S, (size - 1) * S, size * S, size * S);

  gdp_comm_reset_counters(c);
  CHECK_OK(gdp_comm_allreduce(c, in, GDP_REDUCE_OP_SUM));
  expect_counters("allreduce", c, (size - 1) * S, (size - 1) * S, size * S, size * S);

  gdp_comm_reset_counters(c);
  CHECK_OK(gdp_comm_broadcast(c, in, 0));
  if (rank == 0) expect_counters("broadcast (root)", c, (size - 1) * S, 0, size * S, S);
  else expect_counters("broadcast", c, 0, S, 0, S);

  /* unequal all-to-all of f64 rows of 2 */
  gdp_comm_reset_counters(c);
  int64_t *sr = malloc((size_t)size * sizeof *sr), *rr = malloc((size_t)size * sizeof *rr);
  int64_t ins = 0, outs = 0;
  for (int j = 0; j < size; j++) {
    ins += sr[j] = uneven_rows(rank, j, 0);
    outs += rr[j] = uneven_rows(j, rank, 0);
  }
  int64_t ishape[2] = {ins, 2}, os[2] = {outs, 2};
  gdp_tensor *ain = NULL, *aout = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, ishape, &ain));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, os, &aout));
  CHECK_OK(gdp_comm_alltoallv(c, aout, rr, ain, sr));
  expect_counters("alltoallv", c, (ins - sr[rank]) * 16, (outs - rr[rank]) * 16, ins * 16, outs * 16);

  /* point to point: the message each way; nothing to itself in the exclusive pair */
  gdp_comm_reset_counters(c);
  gdp_tensor *in2 = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, shape, &in2));
  CHECK_OK(gdp_comm_sendrecv(c, in, (rank + 1) % size, in2, (rank + size - 1) % size, 1));
  gdp_tensor_free(in2);
  int64_t other = size > 1 ? S : 0;
  expect_counters("sendrecv", c, other, other, S, S);

  /* a failing call counts nothing */
  gdp_comm_reset_counters(c);
  CHECK_ERR(gdp_comm_allgather(c, in, in), GDP_ERR_SHAPE, "out: expected");
  expect_counters("failed allgather", c, 0, 0, 0, 0);
  free(sr);
  free(rr);
  gdp_tensor_free(in);
  gdp_tensor_free(out);
  gdp_tensor_free(ain);
  gdp_tensor_free(aout);
}

/* ------------------------------------------------------------------ argument errors */

static void test_arg_errors(gdp_comm *c) {
  int size = gdp_comm_size(c);
  int64_t s3[1] = {3}, s2[2] = {size, 3}, bad2[2] = {size + 1, 3};
  gdp_tensor *a = NULL, *o = NULL, *ob = NULL, *oi = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, s3, &a));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, s2, &o));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, bad2, &ob));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I32, 2, s2, &oi));
  CHECK_ERR(gdp_comm_allgather(NULL, o, a), GDP_ERR_INVALID_ARG, "communicator");
  CHECK_ERR(gdp_comm_allgather(c, o, NULL), GDP_ERR_INVALID_ARG, "in is NULL");
  CHECK_ERR(gdp_comm_allgather(c, ob, a), GDP_ERR_SHAPE, "out: expected [");
  CHECK_ERR(gdp_comm_allgather(c, oi, a), GDP_ERR_DTYPE, "one dtype");
  CHECK_ERR(gdp_comm_allreduce(c, a, (gdp_reduce_op)7), GDP_ERR_INVALID_ARG, "op:");
  CHECK_ERR(gdp_comm_broadcast(c, a, size), GDP_ERR_INVALID_ARG, "root:");
  CHECK_ERR(gdp_comm_broadcast(c, a, -1), GDP_ERR_INVALID_ARG, "root:");
  CHECK_ERR(gdp_comm_sendrecv(c, a, 0, o, 0, -2), GDP_ERR_INVALID_ARG, "tag:");
  CHECK_ERR(gdp_comm_sendrecv(c, a, size, o, 0, 0), GDP_ERR_INVALID_ARG, "dst:");
  CHECK_ERR(gdp_comm_sendrecv(c, a, 0, a, 0, 0), GDP_ERR_INVALID_ARG, "share storage");
  CHECK_ERR(gdp_comm_sendrecv(c, a, 0, oi, 0, 0), GDP_ERR_DTYPE, "one dtype");
  CHECK_ERR(gdp_comm_send(c, a, size, 0), GDP_ERR_INVALID_ARG, "peer:");
  CHECK_ERR(gdp_comm_recv(c, a, -1, 0), GDP_ERR_INVALID_ARG, "peer:");
  /* all-to-all */
  int64_t rows3[1] = {3 * size};
  gdp_tensor *x = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, rows3, &x));
  int64_t *cnt = calloc((size_t)size, sizeof *cnt);
  CHECK_ERR(gdp_comm_alltoallv(c, x, cnt, x, cnt), GDP_ERR_SHAPE, "send_rows sum to 0");
  cnt[0] = -1;
  CHECK_ERR(gdp_comm_alltoallv(c, x, cnt, x, cnt), GDP_ERR_INVALID_ARG, ">= 0");
  CHECK_ERR(gdp_comm_alltoallv(c, x, NULL, x, cnt), GDP_ERR_INVALID_ARG, "recv_rows is NULL");
  CHECK_ERR(gdp_comm_alltoall(c, o, x), GDP_ERR_SHAPE, "out: expected in's shape");
  if (size > 1) {
    int64_t odd[1] = {size + 1};
    gdp_tensor *y = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, odd, &y));
    CHECK_ERR(gdp_comm_alltoall(c, y, y), GDP_ERR_SHAPE, "equal blocks");
    gdp_tensor_free(y);
  }
  gdp_tensor *scalar = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 0, NULL, &scalar));
  CHECK_ERR(gdp_comm_alltoall(c, scalar, scalar), GDP_ERR_SHAPE, "at least 1 dim");
  CHECK(gdp_comm_rank(NULL) == -1 && gdp_comm_size(NULL) == -1 && gdp_comm_is_mpi(NULL) == 0,
        "NULL communicator queries");
  gdp_comm_free(NULL);
  CHECK(strcmp(gdp_reduce_op_name(GDP_REDUCE_OP_MAX), "max") == 0, "reduce op name");
  free(cnt);
  gdp_tensor_free(scalar);
  gdp_tensor_free(x);
  gdp_tensor_free(a);
  gdp_tensor_free(o);
  gdp_tensor_free(ob);
  gdp_tensor_free(oi);
}

/* ------------------------------------------------------------------ checked mode, pieces */

/* A communicator made with GDP_COMM_CHECK=1 and GDP_COMM_MAX_COUNT=9: arguments are
 * agreed before each call, and MPI calls are cut into pieces of at most 9 elements or
 * use block/row datatypes, so those paths run on small data (with up to 4 ranks). */
static void test_checked_small_pieces(gdp_comm *world) {
  setenv("GDP_COMM_CHECK", "1", 1);
  setenv("GDP_COMM_MAX_COUNT", "9", 1);
  gdp_comm *c = NULL;
  CHECK_OK(gdp_comm_split(world, 0, R, &c));
  unsetenv("GDP_COMM_CHECK");
  unsetenv("GDP_COMM_MAX_COUNT");
  if (!c) return;
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  /* everything again: allgather blocks of 21 elements (a block datatype), all-to-alls of
   * 7-element rows (a row datatype) and of 1-element rows (element counts), allreduce of
   * 13 elements in 2 pieces, sendrecv of 3 + 4r elements (up to 2 pieces) */
  static const int64_t s2[] = {3, 7};
  for (int mode = 0; mode < 4; mode++) check_allgather(c, GDP_DTYPE_F64, 2, s2, mode);
  check_allgather(c, GDP_DTYPE_BF16, 2, s2, 1);
  for (int variant = 0; variant < 3; variant++) check_alltoallv(c, GDP_DTYPE_I64, variant, 0, 0, 7);
  {
    /* everything to rank 0: it receives size*(size+1)/2 rows, more than 9 (the row
     * datatype's count limit here) from size 4 on; checked mode makes that an error on
     * every rank instead of a hang */
    int64_t *sr = calloc((size_t)size, sizeof *sr), *rr = calloc((size_t)size, sizeof *rr);
    sr[0] = rank + 1;
    for (int j = 0; rank == 0 && j < size; j++) rr[j] = j + 1;
    int64_t ishape[2] = {rank + 1, 7}, oshape[2] = {rank == 0 ? size * (size + 1) / 2 : 0, 7};
    gdp_tensor *ai = NULL, *ao = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I64, 2, ishape, &ai));
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I64, 2, oshape, &ao));
    gdp_status st = gdp_comm_alltoallv(c, ao, rr, ai, sr);
    if (size * (size + 1) / 2 > 9)
      CHECK(st == GDP_ERR_UNSUPPORTED && strstr(gdp_last_error(), "exchange smaller pieces"),
            "alltoallv beyond the count limit: rank %d got %s: %s", rank, gdp_status_name(st),
            gdp_last_error());
    else
      CHECK(st == GDP_OK, "alltoallv within the count limit: %s", gdp_last_error());
    gdp_tensor_free(ai);
    gdp_tensor_free(ao);
    free(sr);
    free(rr);
  }
  check_alltoallv(c, GDP_DTYPE_F32, 0, 1, 1, 7);
  check_alltoallv(c, GDP_DTYPE_F32, 0, 0, 0, 1); /* 1-element rows, element counts */
  test_allreduce_broadcast(c);
  test_p2p(c);
  test_counters(c);

  if (size >= 2) {
    /* shapes that differ across ranks: an error on every rank, not a hang */
    int64_t n1[1] = {rank == size - 1 ? 4 : 3};
    gdp_tensor *t = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, n1, &t));
    gdp_status st = gdp_comm_allreduce(c, t, GDP_REDUCE_OP_SUM);
    CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "gdp_comm_allreduce") &&
              strstr(gdp_last_error(), "differ"),
          "checked allreduce with differing shapes: rank %d got %s: %s", rank, gdp_status_name(st),
          gdp_last_error());
    st = gdp_comm_broadcast(c, t, rank == 0 ? 1 : 0);
    CHECK(st == GDP_ERR_INVALID_ARG, "checked broadcast with differing roots: rank %d got %s", rank,
          gdp_status_name(st));
    /* a bad argument on rank 0 only: every rank fails with rank 0's status */
    int64_t o_ok[2] = {size, 3}, o_bad[2] = {size, 5};
    int64_t three[1] = {3};
    gdp_tensor *in = NULL, *out = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, three, &in));
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, rank == 0 ? o_bad : o_ok, &out));
    st = gdp_comm_allgather(c, out, in);
    CHECK(st == GDP_ERR_SHAPE && strstr(gdp_last_error(), "ranks 0)") &&
              strstr(gdp_last_error(), "out: expected"),
          "checked allgather, bad out on rank 0: rank %d got %s: %s", rank, gdp_status_name(st),
          gdp_last_error());
    /* all-to-all row counts that do not match between ranks (each locally consistent) */
    int64_t *sr = calloc((size_t)size, sizeof *sr), *rr = calloc((size_t)size, sizeof *rr);
    sr[0] = 1;                                /* every rank sends one row to rank 0 */
    if (rank == 0) rr[0] = size;              /* rank 0 expects them all from itself */
    int64_t one[2] = {1, 2}, many[2] = {rank == 0 ? size : 0, 2};
    gdp_tensor *ai = NULL, *ao = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, one, &ai));
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, many, &ao));
    st = gdp_comm_alltoallv(c, ao, rr, ai, sr);
    CHECK(st == GDP_ERR_SHAPE && strstr(gdp_last_error(), "which sends"),
          "checked alltoallv with mismatched counts: rank %d got %s: %s", rank, gdp_status_name(st),
          gdp_last_error());
    /* agreement is control data, never cut into pieces */
    int64_t many_v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_OK(gdp_comm_agree_values(c, "long", many_v, 8));
    many_v[7] = rank == size - 1 ? -8 : 8;
    st = gdp_comm_agree_values(c, "long", many_v, 8);
    CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "index 7"),
          "agree_values of 8, last differs: rank %d got %s: %s", rank, gdp_status_name(st),
          gdp_last_error());
    /* still usable */
    CHECK_OK(gdp_comm_barrier(c));
    free(sr);
    free(rr);
    gdp_tensor_free(ai);
    gdp_tensor_free(ao);
    gdp_tensor_free(in);
    gdp_tensor_free(out);
    gdp_tensor_free(t);
  }
  gdp_comm_free(c);
}

/* ------------------------------------------------------------------ message size errors */

static void test_recv_size_errors(gdp_comm *c) {
  int rank = gdp_comm_rank(c), size = gdp_comm_size(c);
  if (size < 2 || !gdp_comm_is_mpi(c)) return;
  int64_t five[1] = {5}, three[1] = {3}, nine[1] = {9};
  gdp_tensor *s = NULL, *small = NULL, *big = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, five, &s));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, three, &small));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, nine, &big));
  if (rank == 0) {
    CHECK_OK(gdp_comm_send(c, s, 1, 11));
    CHECK_OK(gdp_comm_send(c, s, 1, 11));
    double v[5] = {0, 1, 2, 3, 4};
    gdp_tensor *t = from_f64(GDP_DTYPE_F64, 1, five, v);
    CHECK_OK(gdp_comm_send(c, t, 1, 12));
    gdp_tensor_free(t);
  } else if (rank == 1) {
    /* a receive smaller or larger than the message: an error, and the message is
     * consumed (the next receive gets the next message) */
    CHECK_ERR(gdp_comm_recv(c, small, 0, 11), GDP_ERR_SHAPE, "sent a message of 40 bytes");
    CHECK_ERR(gdp_comm_recv(c, big, 0, 11), GDP_ERR_SHAPE, "expects 9 elements");
    CHECK_OK(gdp_comm_recv(c, s, 0, 12));
    double want[5] = {0, 1, 2, 3, 4};
    expect_values("recv after dropped messages", s, want, 5);
  }
  CHECK_OK(gdp_comm_barrier(c));
  gdp_tensor_free(s);
  gdp_tensor_free(small);
  gdp_tensor_free(big);
}

/* ------------------------------------------------------------------ size 1 */

static void test_self(void) {
  gdp_comm *c = NULL;
  CHECK_OK(gdp_comm_self(&c));
  CHECK(c && gdp_comm_size(c) == 1 && gdp_comm_rank(c) == 0 && !gdp_comm_is_mpi(c),
        "gdp_comm_self: size %d rank %d mpi %d", gdp_comm_size(c), gdp_comm_rank(c), gdp_comm_is_mpi(c));
  test_allgather(c);
  test_alltoall(c);
  test_allreduce_broadcast(c);
  test_p2p(c);
  test_agree(c);
  test_counters(c);
  test_arg_errors(c);
  /* a size-1 non-MPI communicator cannot send to itself alone */
  int64_t two[1] = {2};
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, two, &t));
  CHECK_ERR(gdp_comm_send(c, t, 0, 0), GDP_ERR_UNSUPPORTED, "sendrecv");
  CHECK_ERR(gdp_comm_recv(c, t, 0, 0), GDP_ERR_UNSUPPORTED, "sendrecv");
  gdp_status st = gdp_comm_agree_status(c, GDP_ERR_IO, "disk full");
  CHECK(st == GDP_ERR_IO && strstr(gdp_last_error(), "disk full"), "self agree_status: %s", gdp_last_error());
  /* split */
  gdp_comm *s = NULL, *none = (gdp_comm *)1;
  CHECK_OK(gdp_comm_split(c, 3, 0, &s));
  CHECK(s && gdp_comm_size(s) == 1, "self split");
  CHECK_OK(gdp_comm_split(c, -1, 0, &none));
  CHECK(none == NULL, "self split with color -1 gives NULL");
  /* refcounts */
  gdp_comm *r = gdp_comm_retain(c);
  gdp_comm_free(r);
  CHECK(gdp_comm_size(c) == 1, "retain/free");
  gdp_tensor_free(t);
  gdp_comm_free(s);
  gdp_comm_free(c);
}

/* ------------------------------------------------------------------ checked by default */

/* Without GDP_COMM_CHECK in the environment the collectives agree on their arguments,
 * and the message names the field that differs; gdp_comm_set_check(c, 0) opts out. */
static void test_checked_by_default(gdp_comm *world) {
  CHECK(gdp_comm_check_enabled(world) == 1, "checking is on by default");
  int rank = gdp_comm_rank(world), size = gdp_comm_size(world);
  if (size < 2) return;
  int64_t n3[1] = {3};
  gdp_tensor *t = NULL, *d = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, n3, &t));
  CHECK_OK(gdp_tensor_zeros(ctx, rank == 1 ? GDP_DTYPE_F64 : GDP_DTYPE_F32, 1, n3, &d));
  gdp_status st = gdp_comm_allreduce(world, t, rank == 1 ? GDP_REDUCE_OP_MAX : GDP_REDUCE_OP_SUM);
  CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "op: rank 0 passes sum, rank 1 passes max"),
        "allreduce with differing ops: rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  st = gdp_comm_allreduce(world, d, GDP_REDUCE_OP_SUM);
  CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "dtype: rank 0 passes f32, rank 1 passes f64"),
        "allreduce with differing dtypes: rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  st = gdp_comm_broadcast(world, t, rank == 1 ? 1 : 0);
  CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "root: rank 0 passes 0, rank 1 passes 1"),
        "broadcast with differing roots: rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  int64_t o_shape[2] = {size, rank == 1 ? 4 : 3}, in_shape[1] = {rank == 1 ? 4 : 3};
  gdp_tensor *in = NULL, *out = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, in_shape, &in));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, o_shape, &out));
  st = gdp_comm_allgather(world, out, in);
  CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "shape: rank 0 passes [3], rank 1 passes [4]"),
        "allgather with differing shapes: rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  st = rank == 1 ? gdp_comm_barrier(world) : gdp_comm_allreduce(world, t, GDP_REDUCE_OP_SUM);
  CHECK(st == GDP_ERR_INVALID_ARG && strstr(gdp_last_error(), "call: rank 0 is in allreduce, rank 1 in barrier"),
        "different collectives: rank %d got %s: %s", rank, gdp_status_name(st), gdp_last_error());
  /* opting out is agreed, and sub-communicators inherit it */
  gdp_comm *sub = NULL;
  CHECK_OK(gdp_comm_split(world, 0, rank, &sub));
  CHECK_OK(gdp_comm_set_check(sub, 0));
  CHECK(gdp_comm_check_enabled(sub) == 0, "set_check(0)");
  CHECK_OK(gdp_comm_allreduce(sub, t, GDP_REDUCE_OP_SUM));
  st = gdp_comm_set_check(sub, rank == 1);
  CHECK(st == GDP_ERR_INVALID_ARG, "set_check with differing flags: rank %d got %s", rank, gdp_status_name(st));
  CHECK_OK(gdp_comm_set_check(sub, 1));
  gdp_comm_free(sub);
  CHECK_OK(gdp_comm_barrier(world));
  gdp_tensor_free(t);
  gdp_tensor_free(d);
  gdp_tensor_free(in);
  gdp_tensor_free(out);
}

int main(void) {
  TEST_BEGIN(20250611);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  gdp_ctx_set_num_threads(ctx, 1);
  gdp_comm *world = NULL, *world2 = NULL;
  CHECK_OK(gdp_comm_world(&world));
  if (!world) TEST_END();
  R = gdp_comm_rank(world);
  N = gdp_comm_size(world);
  const char *env_size = getenv("OMPI_COMM_WORLD_SIZE");
  printf("# rank %d of %d (%s)\n", R, N, gdp_comm_is_mpi(world) ? "MPI" : "no MPI");
  if (env_size) {
    CHECK(N == atoi(env_size) && gdp_comm_is_mpi(world), "world size %d, mpirun started %s", N, env_size);
  } else {
    CHECK(N == 1 && R == 0 && !gdp_comm_is_mpi(world), "outside mpirun: size %d mpi %d", N,
          gdp_comm_is_mpi(world));
  }
  CHECK_OK(gdp_comm_world(&world2));
  CHECK(world2 == world, "gdp_comm_world returns the one process-wide communicator");
  gdp_comm_free(world2);

  test_self();
  test_allgather(world);
  test_alltoall(world);
  test_allreduce_broadcast(world);
  test_p2p(world);
  test_split(world);
  test_agree(world);
  test_counters(world);
  test_arg_errors(world);
  test_checked_small_pieces(world);
  test_checked_by_default(world);
  test_recv_size_errors(world);
  CHECK_OK(gdp_comm_barrier(world));

  gdp_comm_free(world);
  gdp_ctx_free(ctx);
  TEST_END();
}
