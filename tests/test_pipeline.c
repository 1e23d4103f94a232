// Tests of the 1F1B pipeline schedule: hand-written action lists, per-stage invariants, and a
// simulator that runs every stage together under blocking transfers to prove the schedules pair
// up (no deadlock, every transfer carries the micro-batch its receiver expects).
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "dist/pipeline.h"
#include "test.h"

#define PIPE_TEST_STAGES 6
#define PIPE_TEST_MICROS 8
#define PIPE_TEST_ACTIONS (6 * PIPE_TEST_MICROS)

// Writes actions as "F0 SF0 RB0 B0"; an exchange is "SF1/RB0" (micro sent / micro2 received).
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
        if (used < len)
            used += snprintf(buf + used, len - used, fmt[a[i].kind], a[i].micro, a[i].micro2);
    }
}

// ---- 1. exact lists, written out by hand from Megatron's loop ----

static void test_exact_lists(void) {
    static const struct {
        int stages, stage, micros;
        const char *expect;
    } cases[] = {
        {1, 0, 3, "F0 B0 F1 B1 F2 B2"},
        {2, 0, 1, "F0 SF0 RB0 B0"},
        {2, 1, 1, "RF0 F0 B0 SB0"},
        {2, 0, 4, "F0 SF0 F1 SF1/RB0 B0 F2 SF2/RB1 B1 F3 SF3/RB2 B2 RB3 B3"},
        {2, 1, 4, "RF0 F0 B0 SB0/RF1 F1 B1 SB1/RF2 F2 B2 SB2/RF3 F3 B3 SB3"},
        {4, 0, 2, "F0 SF0 F1 SF1 RB0 B0 RB1 B1"},
        {4, 1, 2, "RF0 F0 SF0 RF1 F1 SF1 RB0 B0 SB0 RB1 B1 SB1"},
        {4, 3, 2, "RF0 F0 B0 SB0/RF1 F1 B1 SB1"},
        {3, 1, 4, "RF0 F0 SF0 RF1 F1 SF1/RB0 B0 SB0/RF2 F2 SF2/RB1 B1 SB1/RF3 F3 SF3/RB2 B2 "
                  "SB2 RB3 B3 SB3"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        PipeAction a[PIPE_TEST_ACTIONS];
        char got[1024];
        size_t n = pipeline_schedule(cases[c].stages, cases[c].stage, cases[c].micros, a);
        pipe_format(a, n, got, sizeof got);
        CHECK_MSG(!strcmp(got, cases[c].expect), "P=%d stage %d M=%d:\n      got      %s\n"
                  "      expected %s", cases[c].stages, cases[c].stage, cases[c].micros, got,
                  cases[c].expect);
    }
}

// ---- 2. invariants of one stage's list ----

// Forwards and backwards each run micro 0, 1, ... once, a backward only after its forward, and the
// activations held in between peak at exactly pipeline_slots. Returns false after reporting.
static bool pipe_check_stage(int stages, int stage, int micros) {
    size_t cap = pipeline_max_actions(micros);
    PipeAction *a = malloc(cap * sizeof *a); // exact size so that ASan sees any overrun
    size_t n = pipeline_schedule(stages, stage, micros, a);
    int next_fwd = 0, next_bwd = 0, peak = 0;
    bool ok = n <= cap;
    CHECK_MSG(ok, "P=%d stage %d M=%d: %zu actions exceed the bound %zu", stages, stage, micros, n,
              cap);
    for (size_t i = 0; ok && i < n; i++) {
        if (a[i].kind == PIPE_FORWARD) {
            ok = a[i].micro == next_fwd++;
            CHECK_MSG(ok, "P=%d stage %d M=%d: action %zu is F%d, expected F%d", stages, stage,
                      micros, i, a[i].micro, next_fwd - 1);
        } else if (a[i].kind == PIPE_BACKWARD) {
            ok = a[i].micro == next_bwd++ && next_bwd <= next_fwd;
            CHECK_MSG(ok, "P=%d stage %d M=%d: action %zu is B%d, expected B%d after F%d",
                      stages, stage, micros, i, a[i].micro, next_bwd - 1, next_bwd - 1);
        }
        peak = next_fwd - next_bwd > peak ? next_fwd - next_bwd : peak;
    }
    int slots = pipeline_slots(stages, stage, micros);
    if (ok) {
        ok = next_fwd == micros && next_bwd == micros && peak == slots;
        CHECK_MSG(ok, "P=%d stage %d M=%d: %d forwards, %d backwards, %d held at peak; expected "
                  "%d, %d, %d", stages, stage, micros, next_fwd, next_bwd, peak, micros, micros,
                  slots);
    }
    free(a);
    return ok;
}

static void test_stage_invariants(void) {
    for (int p = 1; p <= PIPE_TEST_STAGES; p++)
        for (int m = 1; m <= PIPE_TEST_MICROS; m++)
            for (int s = 0; s < p; s++) pipe_check_stage(p, s, m);
}

// ---- 3. simulator: all stages under blocking (rendezvous) transfers ----

typedef struct {
    int stages, micros;
    PipeAction a[PIPE_TEST_STAGES][PIPE_TEST_ACTIONS];
    size_t n[PIPE_TEST_STAGES];
} PipeProgram;

static void pipe_program_build(PipeProgram *p, int stages, int micros) {
    p->stages = stages, p->micros = micros;
    for (int s = 0; s < stages; s++) p->n[s] = pipeline_schedule(stages, s, micros, p->a[s]);
}

// One direction of one transfer. Link l joins stages l and l + 1; forward data flows up it,
// backward data down.
typedef struct {
    bool backward, send;
    int link, micro;
} SimHalf;

typedef struct {
    size_t pc;
    bool half_done[2];                // halves of the current action already matched
    bool fwd_done[PIPE_TEST_MICROS], bwd_done[PIPE_TEST_MICROS];
    bool act_arrived[PIPE_TEST_MICROS], grad_arrived[PIPE_TEST_MICROS];
} SimStage;

typedef enum { SIM_OK, SIM_DEADLOCK, SIM_MISMATCH, SIM_EARLY, SIM_NO_PEER } SimVerdict;
static const char *sim_verdict_names[] = {"ok", "deadlock", "mismatch", "early", "no peer"};

typedef struct {
    const PipeProgram *p;
    SimStage st[PIPE_TEST_STAGES];
    SimVerdict verdict;
    char why[512];
} Sim;

static SimHalf sim_plain(PipeActionKind kind, int stage, int micro) {
    bool backward = kind == PIPE_SEND_BACKWARD || kind == PIPE_RECV_BACKWARD;
    bool send = kind == PIPE_SEND_FORWARD || kind == PIPE_SEND_BACKWARD;
    bool down = kind == PIPE_RECV_FORWARD || kind == PIPE_SEND_BACKWARD; // talks to stage - 1
    return (SimHalf){backward, send, down ? stage - 1 : stage, micro};
}

// The transfers an action posts (none for compute).
static int sim_halves(PipeAction a, int stage, SimHalf h[2]) {
    switch (a.kind) {
    case PIPE_FORWARD:
    case PIPE_BACKWARD: return 0;
    case PIPE_SEND_FORWARD_RECV_BACKWARD:
        h[0] = sim_plain(PIPE_SEND_FORWARD, stage, a.micro);
        h[1] = sim_plain(PIPE_RECV_BACKWARD, stage, a.micro2);
        return 2;
    case PIPE_SEND_BACKWARD_RECV_FORWARD:
        h[0] = sim_plain(PIPE_SEND_BACKWARD, stage, a.micro);
        h[1] = sim_plain(PIPE_RECV_FORWARD, stage, a.micro2);
        return 2;
    default: h[0] = sim_plain(a.kind, stage, a.micro); return 1;
    }
}

static bool sim_fail(Sim *sim, SimVerdict v, const char *what, int stage, size_t pc) {
    char act[32];
    pipe_format(&sim->p->a[stage][pc], 1, act, sizeof act);
    snprintf(sim->why, sizeof sim->why, "stage %d action %zu (%s): %s", stage, pc, act, what);
    sim->verdict = v;
    return false;
}

// Index of the current action's unmatched half on (backward, link, send), or -1.
static int sim_pending(const Sim *sim, int stage, bool backward, int link, bool send) {
    const SimStage *st = &sim->st[stage];
    if (st->pc >= sim->p->n[stage]) return -1;
    SimHalf h[2];
    int nh = sim_halves(sim->p->a[stage][st->pc], stage, h);
    for (int i = 0; i < nh; i++)
        if (!st->half_done[i] && h[i].backward == backward && h[i].link == link &&
            h[i].send == send)
            return i;
    return -1;
}

// Pairs a posted send with a posted receive on one direction of one link. Sets *moved on a match;
// returns false on an error.
static bool sim_match(Sim *sim, bool backward, int link, bool *moved) {
    int from = backward ? link + 1 : link, to = backward ? link : link + 1;
    int hs = sim_pending(sim, from, backward, link, true);
    int hr = sim_pending(sim, to, backward, link, false);
    if (hs < 0 || hr < 0) return true;
    SimStage *sf = &sim->st[from], *sr = &sim->st[to];
    SimHalf s[2], r[2];
    sim_halves(sim->p->a[from][sf->pc], from, s);
    sim_halves(sim->p->a[to][sr->pc], to, r);
    int m = s[hs].micro;
    if (m != r[hr].micro) {
        char what[128];
        snprintf(what, sizeof what, "receives micro %d but stage %d sends micro %d", r[hr].micro,
                 from, m);
        return sim_fail(sim, SIM_MISMATCH, what, to, sr->pc);
    }
    if (!(backward ? sf->bwd_done[m] : sf->fwd_done[m]))
        return sim_fail(sim, SIM_EARLY, "sends a result not yet computed", from, sf->pc);
    sf->half_done[hs] = sr->half_done[hr] = true;
    (backward ? sr->grad_arrived : sr->act_arrived)[m] = true;
    *moved = true;
    return true;
}

// Runs the current action of a stage if it can complete: compute always does (after checking its
// input arrived), a transfer once all its halves are matched.
static bool sim_advance(Sim *sim, int stage, bool *moved) {
    SimStage *st = &sim->st[stage];
    if (st->pc >= sim->p->n[stage]) return true;
    PipeAction a = sim->p->a[stage][st->pc];
    SimHalf h[2];
    int nh = sim_halves(a, stage, h);
    bool last = stage == sim->p->stages - 1;
    if (a.kind == PIPE_FORWARD) {
        if (stage > 0 && !st->act_arrived[a.micro])
            return sim_fail(sim, SIM_EARLY, "runs before its activation arrived", stage, st->pc);
        st->fwd_done[a.micro] = true;
    } else if (a.kind == PIPE_BACKWARD) {
        if (!st->fwd_done[a.micro] || (!last && !st->grad_arrived[a.micro]))
            return sim_fail(sim, SIM_EARLY, "runs before its forward or gradient", stage, st->pc);
        st->bwd_done[a.micro] = true;
    } else if (!(st->half_done[0] && (nh < 2 || st->half_done[1]))) {
        return true;
    }
    st->pc++;
    st->half_done[0] = st->half_done[1] = false;
    *moved = true;
    return true;
}

// Every transfer must name a neighbour that exists and a micro-batch in range.
static bool sim_check_peers(Sim *sim) {
    const PipeProgram *p = sim->p;
    for (int s = 0; s < p->stages; s++)
        for (size_t i = 0; i < p->n[s]; i++) {
            SimHalf h[2];
            int nh = sim_halves(p->a[s][i], s, h);
            if (p->a[s][i].micro < 0 || p->a[s][i].micro >= p->micros)
                return sim_fail(sim, SIM_NO_PEER, "micro-batch out of range", s, i);
            for (int k = 0; k < nh; k++)
                if (h[k].link < 0 || h[k].link >= p->stages - 1 || h[k].micro < 0 ||
                    h[k].micro >= p->micros)
                    return sim_fail(sim, SIM_NO_PEER, "no such neighbour or micro-batch", s, i);
        }
    return true;
}

static void sim_report_deadlock(Sim *sim) {
    size_t used = snprintf(sim->why, sizeof sim->why, "deadlock:");
    for (int s = 0; s < sim->p->stages && used < sizeof sim->why; s++) {
        char act[32] = "done";
        if (sim->st[s].pc < sim->p->n[s])
            pipe_format(&sim->p->a[s][sim->st[s].pc], 1, act, sizeof act);
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
        for (int l = 0; l < p->stages - 1; l++)
            if (!sim_match(sim, false, l, &moved) || !sim_match(sim, true, l, &moved))
                return sim->verdict;
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
        for (int m = 1; m <= PIPE_TEST_MICROS; m++) {
            pipe_program_build(&prog, p, m);
            CHECK_MSG(sim_run(&sim, &prog) == SIM_OK, "P=%d M=%d: %s", p, m, sim.why);
        }
}

// Swaps two actions of one stage and expects the simulator to catch it, proving it can fail.
static void pipe_expect_broken(int stages, int micros, int stage, size_t i, size_t j,
                               SimVerdict expect) {
    static Sim sim;
    static PipeProgram prog;
    pipe_program_build(&prog, stages, micros);
    PipeAction t = prog.a[stage][i];
    prog.a[stage][i] = prog.a[stage][j], prog.a[stage][j] = t;
    char list[512];
    pipe_format(prog.a[stage], prog.n[stage], list, sizeof list);
    SimVerdict got = sim_run(&sim, &prog);
    CHECK_MSG(got == expect, "P=%d M=%d stage %d mutated to \"%s\": verdict %s (%s), expected %s",
              stages, micros, stage, list, sim_verdict_names[got], sim.why,
              sim_verdict_names[expect]);
}

static void test_simulator_catches_broken_schedules(void) {
    // Stage 0 of P=2 M=1 is "F0 SF0 RB0 B0": receiving before sending blocks both stages.
    pipe_expect_broken(2, 1, 0, 1, 2, SIM_DEADLOCK);
    // Stage 0 of P=2 M=2 is "F0 SF0 F1 SF1/RB0 B0 RB1 B1": RB1 first meets stage 1's gradient 0.
    pipe_expect_broken(2, 2, 0, 3, 5, SIM_MISMATCH);
    // Stage 1 of P=2 M=1 is "RF0 F0 B0 SB0": a forward before its input arrives.
    pipe_expect_broken(2, 1, 1, 0, 1, SIM_EARLY);
}

// ---- 4. slots, bubble and the action bound ----

static void test_slots_and_bubble(void) {
    // The action bound is tight: a middle stage that only warms up and cools down uses it all.
    PipeAction a[PIPE_TEST_ACTIONS];
    CHECK(pipeline_schedule(4, 1, 2, a) == pipeline_max_actions(2));
    CHECK(pipeline_slots(4, 0, 8) == 4);
    CHECK(pipeline_slots(4, 3, 8) == 1);
    CHECK(pipeline_slots(4, 1, 2) == 2);
    CHECK(pipeline_slots(1, 0, 5) == 1);
    CHECK_CLOSE(pipeline_bubble_fraction(1, 8), 0.0, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(4, 8), 3.0 / 11, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(8, 1), 7.0 / 8, 0, 1e-15);
    CHECK_CLOSE(pipeline_bubble_fraction(2, 4), 1.0 / 5, 0, 1e-15);
}

const TestCase pipeline_tests[] = {
    {"pipeline_exact_lists", test_exact_lists},
    {"pipeline_stage_invariants", test_stage_invariants},
    {"pipeline_simulated_runs_complete", test_simulated_runs_complete},
    {"pipeline_simulator_catches_broken_schedules", test_simulator_catches_broken_schedules},
    {"pipeline_slots_and_bubble", test_slots_and_bubble},
    {0},
};
