// The 1F1B pipeline schedule (non-interleaved, as Megatron-LM's): for one stage of P, the ordered
// actions that run M micro-batches through forward and backward with at most P - stage activations
// in flight. Communication is paired so that blocking transfers never deadlock: every send meets a
// receive (plain, or half of an exchange) posted by the neighbouring stage in the same order.
#pragma once
#include <stddef.h>

typedef enum {
    PIPE_FORWARD,             // forward of `micro` on this stage
    PIPE_BACKWARD,            // backward of `micro` on this stage
    PIPE_RECV_FORWARD,        // receive the activation of `micro` from stage - 1
    PIPE_SEND_FORWARD,        // send the activation of `micro` to stage + 1
    PIPE_RECV_BACKWARD,       // receive the gradient of `micro` from stage + 1
    PIPE_SEND_BACKWARD,       // send the gradient of `micro` to stage - 1
    PIPE_SEND_FORWARD_RECV_BACKWARD, // exchange with stage + 1: activation of `micro` out,
                                     // gradient of `micro2` in
    PIPE_SEND_BACKWARD_RECV_FORWARD, // exchange with stage - 1: gradient of `micro` out,
                                     // activation of `micro2` in
} PipeActionKind;

typedef struct {
    PipeActionKind kind;
    int micro, micro2;
} PipeAction;

// Upper bound on the actions of one stage (for sizing the array given to pipeline_schedule).
size_t pipeline_max_actions(int micro_batches);
// Fills `out` with the actions of `stage` (0 <= stage < stages) and returns their number. The first
// stage has no receive-forward or send-backward halves, the last none toward stage + 1; a
// one-stage pipeline is forward, backward, forward, backward...
size_t pipeline_schedule(int stages, int stage, int micro_batches, PipeAction *out);
// Activations a stage holds at once: min(stages - stage, micro_batches).
int pipeline_slots(int stages, int stage, int micro_batches);
// Idle fraction of the schedule with equal stage times: (P - 1) / (M + P - 1).
double pipeline_bubble_fraction(int stages, int micro_batches);
