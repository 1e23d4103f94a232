// Tests of the pipeline schedules (1F1B and interleaved 1F1B): hand-written action lists, per-stage
// invariants, the refusal of impossible requests, a simulator that runs every stage together under
// blocking transfers matched as MPI matches them (per pair of ranks, in order) to prove the
// schedules complete (no deadlock, every transfer carries what its receiver expects), and the
// bubble of the timed schedule against its formula.
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "dist/pipeline.h"
#include "plan/pipe_time.h"
#include "test.h"

#define PIPE_TEST_STAGES 6
#define PIPE_TEST_CHUNKS 3
#define PIPE_TEST_MICROS 12
#define PIPE_TEST_ACTIONS (6 * PIPE_TEST_CHUNKS * PIPE_TEST_MICROS)

// Writes actions as "F0 SF0 RB0 B0"; an exchange is "SF1/RB0" (micro sent / micro2 received); with
// several chunks each action carries its chunk: "F0.1" is micro 0 through chunk 1.
static void pipe_format(const PipeAction *a, size_t n, char *buf, size_t len) {
    static const char *fmt[] = {
        [PIPE_FORWARD] = "F%d",          [PIPE_BACKWARD] = "B%d",
        [PIPE_RECV_FORWARD] = "RF%d",    [PIPE_SEND_FORWARD] = "SF%d",
        [PIPE_RECV_BACKWARD] = "RB%d",   [PIPE_SEND_BACKWARD] = "SB%d",
        [PIPE_SEND_FORWARD_RECV_BACKWARD] = "SF%d/RB%d",
        [PIPE_SEND_BACKWARD_RECV_FORWARD] = "SB%d/RF%d",
    };
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && used < len; i++) {
        if (i) used += snprintf(buf + used, len - used, " ");
        if (used < len) used += snprintf(buf + used, len - used, fmt[a[i].kind], a[i].micro, a[i].micro2);
        if (a[i].chunk && used < len) used += snprintf(buf + used, len - used, ".%d", a[i].chunk);
    }
}

// ---- 1. exact lists: Megatron's loops written out by hand ----

static void test_exact_lists(void) {
    static const struct {
        int stages, v, stage, micros;
        const char *expect;
    } cases[] = {
        {1, 1, 0, 3, "F0 B0 F1 B1 F2 B2"},
        {2, 1, 0, 1, "F0 SF0 RB0 B0"},
        {2, 1, 1, 1, "RF0 F0 B0 SB0"},
        {2, 1, 0, 4, "F0 SF0 F1 SF1/RB0 B0 F2 SF2/RB1 B1 F3 SF3/RB2 B2 RB3 B3"},
        {2, 1, 1, 4, "RF0 F0 B0 SB0/RF1 F1 B1 SB1/RF2 F2 B2 SB2/RF3 F3 B3 SB3"},
        {4, 1, 0, 2, "F0 SF0 F1 SF1 RB0 B0 RB1 B1"},
        {4, 1, 1, 2, "RF0 F0 SF0 RF1 F1 SF1 RB0 B0 SB0 RB1 B1 SB1"},
        {4, 1, 3, 2, "RF0 F0 B0 SB0/RF1 F1 B1 SB1"},
        {3, 1, 1, 4, "RF0 F0 SF0 RF1 F1 SF1/RB0 B0 SB0/RF2 F2 SF2/RB1 B1 SB1/RF3 F3 SF3/RB2 B2 "
                     "SB2 RB3 B3 SB3"},
        // Interleaved, 2 stages x 2 chunks, 2 micro-batches: virtual stages 0 (stage 0), 1 (stage 1),
        // 2 (stage 0), 3 (stage 1). Stage 0 warms up with all four forwards (2 (P - 1) + (v - 1) P),
        // stage 1 with two, then runs a forward and a backward a round. Transfers follow the round
        // their data is made in (stage 1 receives activation 1 before it sends its own output 0).
        {2, 2, 0, 2, "F0 SF0 F1 SF1 RF0.1 F0.1 SF0.1 RF1.1 F1.1 SF1.1 RB0.1 B0.1 SB0.1 RB1.1 B1.1 "
                     "SB1.1 RB0 B0 RB1 B1"},
        {2, 2, 1, 2, "RF0 F0 RF1 SF0 F1 RF0.1 SF1 F0.1 B0.1 RF1.1 SB0.1 F1.1 B1.1 RB0 SB1.1 B0 RB1 SB0 B1 SB1"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        PipeAction a[PIPE_TEST_ACTIONS];
        char got[1024];
        size_t n = pipeline_schedule(cases[c].stages, cases[c].v, cases[c].stage, cases[c].micros, a);
        pipe_format(a, n, got, sizeof got);
        CHECK_MSG(!strcmp(got, cases[c].expect), "P=%d v=%d stage %d M=%d:\n      got      %s\n"
                  "      expected %s", cases[c].stages, cases[c].v, cases[c].stage, cases[c].micros, got,
                  cases[c].expect);
    }
}

// ---- 2. what may be asked ----

// Interleaving needs several stages and micro-batches in groups of the stage count; the refusal
// names the keys.
static void test_check_refuses_what_cannot_interleave(void) {
    for (int p = 1; p <= 4; p++)
        for (int v = 1; v <= PIPE_TEST_CHUNKS; v++)
            for (int m = 1; m <= PIPE_TEST_MICROS; m++) {
                MoeErr err = "";
                bool ok = pipeline_check(p, v, m, err) == 0, expect = v == 1 || (p >= 2 && m % p == 0);
                CHECK_MSG(ok == expect, "P=%d v=%d M=%d: %s, expected %s (%s)", p, v, m, ok ? "accepted" : "refused",
                          expect ? "accepted" : "refused", err);
                if (!ok) CHECK_MSG(strstr(err, "parallel.virtual_stages"), "message without the key: %s", err);
            }
    MoeErr err;
    CHECK(pipeline_check(4, 2, 6, err) != 0 && strstr(err, "train.micro_batches = 6 must be a multiple of 4"));
    CHECK(pipeline_check(1, 2, 4, err) != 0 && strstr(err, "needs parallel.pp >= 2"));
    CHECK(pipeline_check(2, PIPE_MAX_CHUNKS + 1, 4, err) != 0);
}

// The (P, v, M) this file runs: every accepted one up to the limits (v = 1 up to 6 stages).
static bool pipe_case(int p, int v, int m) {
    MoeErr err;
    return (v == 1 || p <= 4) && pipeline_check(p, v, m, err) == 0;
}

// ---- 3. invariants of one stage's list ----

// Per chunk, forwards and backwards each run micro 0, 1, ... once, a backward only after its
// forward; the activations held (from their input's arrival, or their forward on the first virtual
// stage, to their backward) peak at exactly pipeline_slots. Returns false after reporting.
static bool pipe_check_stage(int stages, int v, int stage, int micros) {
    size_t cap = pipeline_max_actions(v, micros);
    PipeAction *a = malloc(cap * sizeof *a); // exact size so that ASan sees any overrun
    size_t n = pipeline_schedule(stages, v, stage, micros, a);
    int next_fwd[PIPE_TEST_CHUNKS] = {0}, next_bwd[PIPE_TEST_CHUNKS] = {0};
    int held[PIPE_TEST_CHUNKS] = {0}, peak[PIPE_TEST_CHUNKS] = {0};
    bool ok = n <= cap;
    CHECK_MSG(ok, "P=%d v=%d stage %d M=%d: %zu actions exceed the bound %zu", stages, v, stage, micros, n, cap);
    for (size_t i = 0; ok && i < n; i++) {
        int c = a[i].chunk;
        bool first = stage == 0 && c == 0;
        if (a[i].kind == PIPE_FORWARD) {
            ok = a[i].micro == next_fwd[c]++;
            held[c] += first;
        } else if (a[i].kind == PIPE_BACKWARD) {
            ok = a[i].micro == next_bwd[c]++ && next_bwd[c] <= next_fwd[c];
            held[c]--;
        } else if (a[i].kind == PIPE_RECV_FORWARD || a[i].kind == PIPE_SEND_BACKWARD_RECV_FORWARD) {
            held[c]++;
        }
        CHECK_MSG(ok, "P=%d v=%d stage %d M=%d: action %zu (micro %d, chunk %d) out of order", stages, v, stage,
                  micros, i, a[i].micro, c);
        peak[c] = held[c] > peak[c] ? held[c] : peak[c];
    }
    for (int c = 0; ok && c < v; c++) {
        int slots = pipeline_slots(stages, v, stage, c, micros);
        ok = next_fwd[c] == micros && next_bwd[c] == micros && peak[c] == slots && slots <= micros;
        CHECK_MSG(ok, "P=%d v=%d stage %d chunk %d M=%d: %d forwards, %d backwards, %d held at peak, %d slots",
                  stages, v, stage, c, micros, next_fwd[c], next_bwd[c], peak[c], slots);
    }
    free(a);
    return ok;
}

static void test_stage_invariants(void) {
    for (int p = 1; p <= PIPE_TEST_STAGES; p++)
        for (int v = 1; v <= PIPE_TEST_CHUNKS; v++)
            for (int m = 1; m <= PIPE_TEST_MICROS; m++)
                for (int s = 0; s < p && pipe_case(p, v, m); s++) pipe_check_stage(p, v, s, m);
}

// ---- 4. simulator: all stages under blocking (rendezvous) transfers ----

typedef struct {
    int stages, v, micros;
    PipeAction a[PIPE_TEST_STAGES][PIPE_TEST_ACTIONS];
    size_t n[PIPE_TEST_STAGES];
} PipeProgram;

static void pipe_program_build(PipeProgram *p, int stages, int v, int micros) {
    p->stages = stages, p->v = v, p->micros = micros;
    for (int s = 0; s < stages; s++) p->n[s] = pipeline_schedule(stages, v, s, micros, p->a[s]);
}

// One direction of one transfer, derived here from the action alone: virtual stage vs = chunk P +
// stage sends its output to vs + 1 and its input's gradient to vs - 1.
typedef struct {
    bool backward, send;
    int from_vs, to_vs, micro; // the virtual stages the data leaves and reaches
} SimHalf;

typedef struct {
    size_t pc;
    bool half_done[2];        // halves of the current action already matched
    bool fwd_done[PIPE_TEST_CHUNKS][PIPE_TEST_MICROS], bwd_done[PIPE_TEST_CHUNKS][PIPE_TEST_MICROS];
    bool act_arrived[PIPE_TEST_CHUNKS][PIPE_TEST_MICROS], grad_arrived[PIPE_TEST_CHUNKS][PIPE_TEST_MICROS];
} SimStage;

typedef enum { SIM_OK, SIM_DEADLOCK, SIM_MISMATCH, SIM_EARLY, SIM_NO_PEER } SimVerdict;
static const char *sim_verdict_names[] = {"ok", "deadlock", "mismatch", "early", "no peer"};

typedef struct {
    const PipeProgram *p;
    SimStage st[PIPE_TEST_STAGES];
    SimVerdict verdict;
    char why[512];
} Sim;

static SimHalf sim_plain(PipeActionKind kind, int vs, int micro) {
    bool backward = kind == PIPE_SEND_BACKWARD || kind == PIPE_RECV_BACKWARD;
    bool send = kind == PIPE_SEND_FORWARD || kind == PIPE_SEND_BACKWARD;
    bool down = kind == PIPE_RECV_FORWARD || kind == PIPE_SEND_BACKWARD; // faces vs - 1
    int other = down ? vs - 1 : vs + 1;
    return (SimHalf){backward, send, send ? vs : other, send ? other : vs, micro};
}

// The transfers an action posts (none for compute).
static int sim_halves(const PipeProgram *p, PipeAction a, int stage, SimHalf h[2]) {
    int vs = a.chunk * p->stages + stage;
    switch (a.kind) {
    case PIPE_FORWARD:
    case PIPE_BACKWARD: return 0;
    case PIPE_SEND_FORWARD_RECV_BACKWARD:
        h[0] = sim_plain(PIPE_SEND_FORWARD, vs, a.micro);
        h[1] = sim_plain(PIPE_RECV_BACKWARD, vs, a.micro2);
        return 2;
    case PIPE_SEND_BACKWARD_RECV_FORWARD:
        h[0] = sim_plain(PIPE_SEND_BACKWARD, vs, a.micro);
        h[1] = sim_plain(PIPE_RECV_FORWARD, vs, a.micro2);
        return 2;
    default: h[0] = sim_plain(a.kind, vs, a.micro); return 1;
    }
}

// The stage a half's other end runs on.
static int sim_peer(const PipeProgram *p, const SimHalf *h) { return (h->send ? h->to_vs : h->from_vs) % p->stages; }

static bool sim_fail(Sim *sim, SimVerdict v, const char *what, int stage, size_t pc) {
    char act[32];
    pipe_format(&sim->p->a[stage][pc], 1, act, sizeof act);
    snprintf(sim->why, sizeof sim->why, "stage %d action %zu (%s): %s", stage, pc, act, what);
    sim->verdict = v;
    return false;
}

// Index of the current action's unmatched half toward `peer` (sending or receiving), or -1.
static int sim_pending(const Sim *sim, int stage, int peer, bool send) {
    const SimStage *st = &sim->st[stage];
    if (st->pc >= sim->p->n[stage]) return -1;
    SimHalf h[2];
    int nh = sim_halves(sim->p, sim->p->a[stage][st->pc], stage, h);
    for (int i = 0; i < nh; i++)
        if (!st->half_done[i] && h[i].send == send && sim_peer(sim->p, &h[i]) == peer) return i;
    return -1;
}

// Pairs a posted send of `from` toward `to` with a posted receive of `to` from `from`, as MPI does
// (per pair of ranks, first come first matched, whatever the data); the pair must then agree on
// what it carries. Sets *moved on a match; returns false on an error.
static bool sim_match(Sim *sim, int from, int to, bool *moved) {
    int hs = sim_pending(sim, from, to, true), hr = sim_pending(sim, to, from, false);
    if (hs < 0 || hr < 0) return true;
    SimStage *sf = &sim->st[from], *sr = &sim->st[to];
    SimHalf s[2], r[2];
    sim_halves(sim->p, sim->p->a[from][sf->pc], from, s);
    sim_halves(sim->p, sim->p->a[to][sr->pc], to, r);
    const SimHalf *x = &s[hs], *y = &r[hr];
    if (x->micro != y->micro || x->backward != y->backward || x->from_vs != y->from_vs || x->to_vs != y->to_vs) {
        char what[160];
        snprintf(what, sizeof what, "receives %s %d for virtual stage %d but stage %d sends %s %d from virtual "
                 "stage %d", y->backward ? "gradient" : "activation", y->micro, y->to_vs, from,
                 x->backward ? "gradient" : "activation", x->micro, x->from_vs);
        return sim_fail(sim, SIM_MISMATCH, what, to, sr->pc);
    }
    int c_from = x->from_vs / sim->p->stages, c_to = x->to_vs / sim->p->stages, m = x->micro;
    if (!(x->backward ? sf->bwd_done[c_from][m] : sf->fwd_done[c_from][m]))
        return sim_fail(sim, SIM_EARLY, "sends a result not yet computed", from, sf->pc);
    sf->half_done[hs] = sr->half_done[hr] = true;
    (x->backward ? sr->grad_arrived : sr->act_arrived)[c_to][m] = true;
    *moved = true;
    return true;
}

// Runs the current action of a stage if it can complete: compute always does (after checking its
// input arrived), a transfer once all its halves are matched.
static bool sim_advance(Sim *sim, int stage, bool *moved) {
    const PipeProgram *p = sim->p;
    SimStage *st = &sim->st[stage];
    if (st->pc >= p->n[stage]) return true;
    PipeAction a = p->a[stage][st->pc];
    SimHalf h[2];
    int nh = sim_halves(p, a, stage, h), c = a.chunk, vs = c * p->stages + stage;
    if (a.kind == PIPE_FORWARD) {
        if (vs > 0 && !st->act_arrived[c][a.micro])
            return sim_fail(sim, SIM_EARLY, "runs before its activation arrived", stage, st->pc);
        st->fwd_done[c][a.micro] = true;
    } else if (a.kind == PIPE_BACKWARD) {
        if (!st->fwd_done[c][a.micro] || (vs < p->stages * p->v - 1 && !st->grad_arrived[c][a.micro]))
            return sim_fail(sim, SIM_EARLY, "runs before its forward or gradient", stage, st->pc);
        st->bwd_done[c][a.micro] = true;
    } else if (!(st->half_done[0] && (nh < 2 || st->half_done[1]))) {
        return true;
    }
    st->pc++;
    st->half_done[0] = st->half_done[1] = false;
    *moved = true;
    return true;
}

// Every action must name a chunk and micro-batch in range and transfers a virtual stage that exists.
static bool sim_check_peers(Sim *sim) {
    const PipeProgram *p = sim->p;
    int V = p->stages * p->v;
    for (int s = 0; s < p->stages; s++)
        for (size_t i = 0; i < p->n[s]; i++) {
            SimHalf h[2];
            PipeAction a = p->a[s][i];
            if (a.micro < 0 || a.micro >= p->micros || a.chunk < 0 || a.chunk >= p->v)
                return sim_fail(sim, SIM_NO_PEER, "micro-batch or chunk out of range", s, i);
            int nh = sim_halves(p, a, s, h);
            for (int k = 0; k < nh; k++)
                if (h[k].from_vs < 0 || h[k].to_vs >= V || h[k].micro < 0 || h[k].micro >= p->micros)
                    return sim_fail(sim, SIM_NO_PEER, "no such virtual stage or micro-batch", s, i);
        }
    return true;
}

static void sim_report_deadlock(Sim *sim) {
    size_t used = snprintf(sim->why, sizeof sim->why, "deadlock:");
    for (int s = 0; s < sim->p->stages && used < sizeof sim->why; s++) {
        char act[32] = "done";
        if (sim->st[s].pc < sim->p->n[s]) pipe_format(&sim->p->a[s][sim->st[s].pc], 1, act, sizeof act);
        used += snprintf(sim->why + used, sizeof sim->why - used, " stage %d at %s;", s, act);
    }
    sim->verdict = SIM_DEADLOCK;
}

// Runs all stages until they finish, block for good, or break a rule; the verdict says which.
static SimVerdict sim_run(Sim *sim, const PipeProgram *p) {
    memset(sim, 0, sizeof *sim);
    sim->p = p;
    if (!sim_check_peers(sim)) return sim->verdict;
    for (bool moved = true; moved;) {
        moved = false;
        for (int from = 0; from < p->stages; from++)
            for (int to = 0; to < p->stages; to++)
                if (from != to && !sim_match(sim, from, to, &moved)) return sim->verdict;
        for (int s = 0; s < p->stages; s++)
            if (!sim_advance(sim, s, &moved)) return sim->verdict;
    }
    for (int s = 0; s < p->stages; s++)
        if (sim->st[s].pc < p->n[s]) {
            sim_report_deadlock(sim);
            return sim->verdict;
        }
    return SIM_OK;
}

static void test_simulated_runs_complete(void) {
    static Sim sim;
    static PipeProgram prog;
    for (int p = 1; p <= PIPE_TEST_STAGES; p++)
        for (int v = 1; v <= PIPE_TEST_CHUNKS; v++)
            for (int m = 1; m <= PIPE_TEST_MICROS; m++) {
                if (!pipe_case(p, v, m)) continue;
                pipe_program_build(&prog, p, v, m);
                CHECK_MSG(sim_run(&sim, &prog) == SIM_OK, "P=%d v=%d M=%d: %s", p, v, m, sim.why);
            }
}

// Swaps two actions of one stage and expects the simulator to catch it, proving it can fail.
static void pipe_expect_broken(int stages, int v, int micros, int stage, size_t i, size_t j, SimVerdict expect) {
    static Sim sim;
    static PipeProgram prog;
    pipe_program_build(&prog, stages, v, micros);
    PipeAction t = prog.a[stage][i];
    prog.a[stage][i] = prog.a[stage][j], prog.a[stage][j] = t;
    char list[1024];
    pipe_format(prog.a[stage], prog.n[stage], list, sizeof list);
    SimVerdict got = sim_run(&sim, &prog);
    CHECK_MSG(got == expect, "P=%d v=%d M=%d stage %d mutated to \"%s\": verdict %s (%s), expected %s", stages, v,
              micros, stage, list, sim_verdict_names[got], sim.why, sim_verdict_names[expect]);
}

static void test_simulator_catches_broken_schedules(void) {
    // Stage 0 of P=2 M=1 is "F0 SF0 RB0 B0": receiving before sending blocks both stages.
    pipe_expect_broken(2, 1, 1, 0, 1, 2, SIM_DEADLOCK);
    // Stage 0 of P=2 M=2 is "F0 SF0 F1 SF1/RB0 B0 RB1 B1": RB1 first meets stage 1's gradient 0.
    pipe_expect_broken(2, 1, 2, 0, 3, 5, SIM_MISMATCH);
    // Stage 1 of P=2 M=1 is "RF0 F0 B0 SB0": a forward before its input arrives.
    pipe_expect_broken(2, 1, 1, 1, 0, 1, SIM_EARLY);
    // Interleaved stage 0 of P=2 v=2 M=2 (lists in test_exact_lists): its send SF1 swapped with its
    // first chunk-1 receive RF0.1 waits for stage 1, which waits for that SF1.
    pipe_expect_broken(2, 2, 2, 0, 3, 4, SIM_DEADLOCK);
    // Stage 1 receiving chunk 1's input (RF0.1) before activation 1 of chunk 0 (RF1): between one
    // pair of ranks MPI matches by order alone, so it would get activation 1 in the wrong buffer.
    pipe_expect_broken(2, 2, 2, 1, 2, 5, SIM_MISMATCH);
}

// ---- 5. slots, bubble and the action bound ----

static void test_slots_and_bubble(void) {
    // The action bound is tight: a middle stage that only warms up and cools down uses it all.
    PipeAction a[PIPE_TEST_ACTIONS];
    CHECK(pipeline_schedule(4, 1, 1, 2, a) == pipeline_max_actions(1, 2));
    CHECK(pipeline_slots(4, 1, 0, 0, 8) == 4);
    CHECK(pipeline_slots(4, 1, 3, 0, 8) == 1);
    CHECK(pipeline_slots(4, 1, 1, 0, 2) == 2);
    CHECK(pipeline_slots(1, 1, 0, 0, 5) == 1);
    CHECK_CLOSE(pipeline_bubble_fraction(1, 1, 8), 0.0, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(4, 1, 8), 3.0 / 11, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(8, 1, 1), 7.0 / 8, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(2, 1, 4), 1.0 / 5, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(4, 2, 8), 3.0 / 19, 0, 1e-15);
}

// With equal stages and free transfers the timed schedule takes (M + (P - 1) / v) (f + b): the
// interleaved bubble is the plain one over v. A micro-batch's forward through a whole stage takes
// f = 1, its backward b = 2, split evenly over the chunks.
static void test_timed_bubble_matches_formula(void) {
    static const int cases[][3] = {{1, 1, 4}, {2, 1, 4}, {4, 1, 8}, {4, 1, 3}, {2, 2, 4}, {4, 2, 8}, {4, 3, 8},
                                   {3, 2, 6}, {2, 3, 2}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int p = cases[i][0], v = cases[i][1], m = cases[i][2];
        PipeStageTime t[PIPE_TEST_STAGES] = {0};
        for (int s = 0; s < p; s++)
            for (int c = 0; c < v; c++) t[s].fwd[c] = 1.0 / v, t[s].bwd[c] = 2.0 / v;
        double busy[PIPE_TEST_STAGES], transfer[PIPE_TEST_STAGES];
        double got = pipe_time_run(p, v, m, t, busy, transfer), expect = (m + (double)(p - 1) / v) * 3;
        CHECK_MSG(got >= expect - 1e-9 && got <= expect + 1e-9, "P=%d v=%d M=%d: %.4f, expected %.4f", p, v, m, got,
                  expect);
        CHECK_CLOSE(busy[0], 3.0 * m, 1e-12, 0);
    }
}

const TestCase pipeline_tests[] = {
    {"pipeline_exact_lists", test_exact_lists},
    {"pipeline_check_refuses_what_cannot_interleave", test_check_refuses_what_cannot_interleave},
    {"pipeline_stage_invariants", test_stage_invariants},
    {"pipeline_simulated_runs_complete", test_simulated_runs_complete},
    {"pipeline_simulator_catches_broken_schedules", test_simulator_catches_broken_schedules},
    {"pipeline_slots_and_bubble", test_slots_and_bubble},
    {"pipeline_timed_bubble_matches_formula", test_timed_bubble_matches_formula},
    {0},
};
