// Communication built from the CommOps primitives, the same for every transport (see comm.h).
#include "comm.h"

void comm_reduce_scatter_part(Comm *c, const void *send, void *recv, size_t n, size_t a, size_t b,
                              CommType t) {
    size_t total = (size_t)c->size * n;
    if (a >= b) return;
    if (a == 0 && b == total) {
        c->ops->reduce_scatter_sum(c, send, recv, n, t);
        return;
    }
    if (c->ops->group_begin) c->ops->group_begin();
    for (int r = (int)(a / n); r < c->size && (size_t)r * n < b; r++) {
        size_t first = (size_t)r * n, end = first + n; // rank r's block
        size_t lo = a > first ? a : first, hi = b < end ? b : end;
        c->ops->reduce_sum(c, comm_at(c, send, lo, t), comm_at(c, recv, lo - first, t), hi - lo, t, r);
    }
    if (c->ops->group_end) c->ops->group_end();
}
