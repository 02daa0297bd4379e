// The buffer layouts of the intranode and internode paths: host arithmetic only (no GPU headers), compiled in
// every build, so that whoever sizes a buffer (the backends when they grow, `uccl-ep-train plan`, through
// the bindings) uses the very functions the kernels' launchers lay the buffers out with.
#include <algorithm>
#include <vector>

#include "common/check.h"
#include "kernels/internode_api.h"
#include "kernels/intranode_api.h"

namespace uccl_ep {
namespace intranode {
using internode::align_up;

RowLayout make_row_layout(int64_t data_bytes, int64_t x_bytes, int64_t scale_bytes, int num_topk, bool with_src) {
  RowLayout l;
  const int64_t per_row = x_bytes + scale_bytes + (int64_t)num_topk * 12 + (with_src ? 4 : 0);
  const int64_t slack = 5 * 256;  // alignment of the five arrays
  if (per_row <= 0 || data_bytes <= slack) return l;
  l.cap_rows = (data_bytes - slack) / per_row;
  int64_t off = 0;
  l.off_x = off;
  off = align_up(off + l.cap_rows * x_bytes, 256);
  l.off_scales = off;
  off = align_up(off + l.cap_rows * scale_bytes, 256);
  l.off_topk_idx = off;
  off = align_up(off + l.cap_rows * num_topk * 8, 256);
  l.off_topk_w = off;
  off = align_up(off + l.cap_rows * num_topk * 4, 256);
  l.off_src = off;
  return l;
}

}  // namespace intranode

namespace internode {

int64_t dispatch_row_bytes(int64_t x_bytes, int64_t scale_bytes, int num_topk, int ranks_per_node) {
  return align_up(x_bytes + scale_bytes + 8 * int64_t(num_topk) + 8 + 4 * int64_t(ranks_per_node), 16);
}

int64_t combine_row_bytes(int64_t y_bytes, int num_topk) { return align_up(y_bytes + 4 * int64_t(num_topk), 16); }

Layout make_layout(const std::vector<int>& rd, int R, int L, int rank, int64_t row_bytes, int64_t crow_bytes,
                   int64_t num_recv_rows) {
  UCCL_CHECK(L >= 1 && L <= kMaxLocal && R % L == 0, "internode layout: ranks per node " << L << " must divide "
                                                                                        << R << " and be 1.." << kMaxLocal);
  const int N = R / L;
  UCCL_CHECK(N <= kMaxNodes, "internode layout: " << N << " nodes; at most " << kMaxNodes << " are supported");
  UCCL_CHECK((int64_t)rd.size() == (int64_t)R * N, "internode layout: rd has " << rd.size() << " entries, expected "
                                                                               << R * N);
  Layout l;
  l.num_nodes = N;
  l.row_bytes = row_bytes;
  l.crow_bytes = crow_bytes;
  segment_rows(rd.data(), R, L, rank, l.send_row0, l.recv_row0);
  l.count_stride = 4 * count_row_ints(R, kMaxExperts, L);
  static_cast<Areas&>(l) = areas_of(l.count_stride, R, l.send_row0[N], l.recv_row0[N], row_bytes, crow_bytes);
  l.nvl_bytes = kNvlHeaderBytes + 2 * align_up(num_recv_rows * std::max(row_bytes, crow_bytes), 256);
  return l;
}

}  // namespace internode
}  // namespace uccl_ep
