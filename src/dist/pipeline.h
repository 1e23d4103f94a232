// Pipeline schedules: for one stage of P, the ordered actions that run M micro-batches through
// forward and backward. With one model chunk per stage (v = 1) it is Megatron-LM's non-interleaved
// 1F1B, with at most P - stage activations in flight; with v chunks per stage (interleaved 1F1B,
// `parallel.virtual_stages`) the layers form P v virtual stages, stage s holding virtual stages
// s, s + P, ..., and the pipeline's idle share falls from (P - 1) / (M + P - 1) to about
// (P - 1) / (v M + P - 1), for more activations in flight. Transfers are paired so that blocking
// ones never deadlock: every send meets a receive posted by its peer in the same order.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/util.h"

#define PIPE_MAX_CHUNKS 8 // model chunks (virtual stages) a stage can hold

typedef enum {
    PIPE_FORWARD,             // forward of `micro` through chunk `chunk` of this stage
    PIPE_BACKWARD,            // backward of `micro` through chunk `chunk`
    PIPE_RECV_FORWARD,        // receive the input of `micro` for chunk `chunk` (previous virtual stage)
    PIPE_SEND_FORWARD,        // send the output of `micro` of chunk `chunk` to the next virtual stage
    PIPE_RECV_BACKWARD,       // receive the gradient of chunk `chunk`'s output of `micro`
    PIPE_SEND_BACKWARD,       // send the gradient of chunk `chunk`'s input of `micro`
    PIPE_SEND_FORWARD_RECV_BACKWARD, // (v = 1) exchange with stage + 1: activation of `micro` out,
                                     // gradient of `micro2` in
    PIPE_SEND_BACKWARD_RECV_FORWARD, // (v = 1) exchange with stage - 1: gradient of `micro` out,
                                     // activation of `micro2` in
} PipeActionKind;

typedef struct {
    PipeActionKind kind;
    int micro, micro2;
    int chunk; // model chunk of this stage the action concerns (0 when v = 1)
} PipeAction;

// One direction of a transfer an action posts: to or from `peer` (a stage), carrying the activation
// (forward) or the gradient (backward) of `micro`.
typedef struct {
    int peer;
    bool send, backward;
    int micro;
} PipeTransfer;

// Whether stages x v chunks can run micro_batches: v >= 1 (at most PIPE_MAX_CHUNKS); v > 1 needs
// several stages and micro_batches a multiple of the stages (interleaved 1F1B groups micro-batches
// by stage count). -1 with a message naming the parallel.* and train.* keys otherwise.
int pipeline_check(int stages, int v, int micro_batches, MoeErr err);
// The transfers of an action of `stage` (0 for compute, 1, or 2 for an exchange); returns their number.
int pipeline_transfers(int stages, int v, int stage, PipeAction a, PipeTransfer out[2]);
// Upper bound on the actions of one stage (for sizing the array given to pipeline_schedule).
size_t pipeline_max_actions(int v, int micro_batches);
// Fills `out` with the actions of `stage` (0 <= stage < stages) and returns their number. The first
// virtual stage has no receive-forward or send-backward halves, the last none toward a next one; a
// one-stage pipeline is forward, backward, forward, backward... Exits on an impossible request.
size_t pipeline_schedule(int stages, int v, int stage, int micro_batches, PipeAction *out);
// Activations chunk `chunk` of a stage holds at once (v = 1: min(stages - stage, micro_batches)).
int pipeline_slots(int stages, int v, int stage, int chunk, int micro_batches);
// Idle fraction with equal stages and free transfers: (P - 1) / (v M + P - 1).
double pipeline_bubble_fraction(int stages, int v, int micro_batches);
