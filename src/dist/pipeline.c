// The 1F1B pipeline schedule declared in pipeline.h: Megatron-LM's non-interleaved order of
// forwards, backwards and the transfers between neighbouring stages, as a list one stage executes.
#include "dist/pipeline.h"

#include "common/util.h"

// The schedule under construction for one stage.
typedef struct {
    int stage, stages;
    PipeAction *out;
    size_t n, cap;
} PipeBuilder;

// The neighbour an action talks to: -1 (stage - 1), +1 (stage + 1), or 0 for compute. Both halves
// of an exchange face the same neighbour, so an exchange is either wholly present or wholly absent.
static int pipeline_peer_offset(PipeActionKind kind) {
    switch (kind) {
    case PIPE_RECV_FORWARD:
    case PIPE_SEND_BACKWARD:
    case PIPE_SEND_BACKWARD_RECV_FORWARD: return -1;
    case PIPE_SEND_FORWARD:
    case PIPE_RECV_BACKWARD:
    case PIPE_SEND_FORWARD_RECV_BACKWARD: return +1;
    default: return 0;
    }
}

// Appends an action, dropping transfers toward a neighbour this stage does not have (the first
// stage reads its input from data, the last computes the loss gradient itself).
static void pipeline_push(PipeBuilder *b, PipeActionKind kind, int micro, int micro2) {
    int peer = b->stage + pipeline_peer_offset(kind);
    if (peer < 0 || peer >= b->stages) return;
    MOE_ASSERT(b->n < b->cap);
    b->out[b->n++] = (PipeAction){kind, micro, micro2};
}

static void pipeline_check_args(int stages, int stage, int micro_batches) {
    MOE_CHECK(stages >= 1 && stage >= 0 && stage < stages,
              "pipeline stage %d of %d is out of range (stages >= 1, 0 <= stage < stages)", stage,
              stages);
    MOE_CHECK(micro_batches >= 1,
              "the pipeline needs at least one micro-batch, got %d (raise the micro-batch count)",
              micro_batches);
}

size_t pipeline_max_actions(int micro_batches) {
    // Each micro-batch is forwarded and backwarded once and its activation and gradient each
    // cross a stage at most once in and once out: six items, fewer actions where exchanges pair
    // them. (Warmup and cooldown micro-batches use all six, so 4M + const is not enough.)
    return 6 * (size_t)(micro_batches > 0 ? micro_batches : 0);
}

size_t pipeline_schedule(int stages, int stage, int micro_batches, PipeAction *out) {
    pipeline_check_args(stages, stage, micro_batches);
    PipeBuilder b = {stage, stages, out, 0, pipeline_max_actions(micro_batches)};
    int m = micro_batches;
    // Stage s forwards P - s - 1 micro-batches ahead so that later stages have work while the
    // first backward travels back.
    int warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int remaining = m - warmup;
    for (int i = 0; i < warmup; i++) {
        pipeline_push(&b, PIPE_RECV_FORWARD, i, 0);
        pipeline_push(&b, PIPE_FORWARD, i, 0);
        pipeline_push(&b, PIPE_SEND_FORWARD, i, 0);
    }
    if (remaining > 0) pipeline_push(&b, PIPE_RECV_FORWARD, warmup, 0);
    for (int i = 0; i < remaining; i++) {
        pipeline_push(&b, PIPE_FORWARD, warmup + i, 0);
        // An exchange, not a send then a receive: both halves are posted at once, so a neighbour
        // that itself sends first (plain or in its own exchange) is never left waiting.
        pipeline_push(&b, PIPE_SEND_FORWARD_RECV_BACKWARD, warmup + i, i);
        pipeline_push(&b, PIPE_BACKWARD, i, 0);
        if (i == remaining - 1)
            pipeline_push(&b, PIPE_SEND_BACKWARD, i, 0);
        else
            pipeline_push(&b, PIPE_SEND_BACKWARD_RECV_FORWARD, i, warmup + i + 1);
    }
    for (int i = remaining; i < m; i++) {
        pipeline_push(&b, PIPE_RECV_BACKWARD, i, 0);
        pipeline_push(&b, PIPE_BACKWARD, i, 0);
        pipeline_push(&b, PIPE_SEND_BACKWARD, i, 0);
    }
    return b.n;
}

int pipeline_slots(int stages, int stage, int micro_batches) {
    pipeline_check_args(stages, stage, micro_batches);
    return stages - stage < micro_batches ? stages - stage : micro_batches;
}

double pipeline_bubble_fraction(int stages, int micro_batches) {
    pipeline_check_args(stages, 0, micro_batches);
    return (double)(stages - 1) / (micro_batches + stages - 1);
}
