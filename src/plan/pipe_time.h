// The pipeline schedule with durations: every stage runs its own action list (dist/pipeline.h),
// compute taking its measured or predicted time and each transfer starting when both ranks have
// reached it (blocking, as the trainer's are), so the step's pipeline time, its bubble and the
// stages' waits come from the schedule itself, unequal stages included.
#pragma once
#include "dist/pipeline.h"

typedef struct {
    double fwd[PIPE_MAX_CHUNKS], bwd[PIPE_MAX_CHUNKS]; // one micro-batch through each chunk
    double link_next;  // one transfer between the stage and the next (the last: and the first)
} PipeStageTime;

// Runs pp stages of v chunks over `micro_batches` micro-batches; returns the time until the last
// stage ends. busy[s] (optional): time stage s computes or transfers; transfer[s]: of it, transfers.
double pipe_time_run(int pp, int v, int micro_batches, const PipeStageTime *t, double *busy, double *transfer);
