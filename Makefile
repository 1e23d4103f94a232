# moe.c build. `make` builds ./moe and the bundled tinyshakespeare token files; `make test` runs
# every test and ends with "N passed, N failed". Two builds share the sources: build/f32 (the
# program) and build/f64 (double precision, used by the unit tests for finite-difference checks).
# `make SANITIZE=1 test` runs the same suite under AddressSanitizer, UndefinedBehaviorSanitizer and
# LeakSanitizer, from objects in build/san; `make fuzz` runs the libFuzzer harnesses (tests/fuzz).

CC      ?= cc
ARCH    ?= -march=native
CFLAGS  ?= -O3 $(ARCH) -g
CFLAGS  += -std=gnu11 -pthread -fopenmp -fno-math-errno -Wall -Wextra -Wno-unused-parameter -Isrc -MMD -MP
LDLIBS  += -pthread -fopenmp -ljansson -lxxhash -lpcre2-8 -lm
# SANITIZE=1: every error of ASan, UBSan or LSan ends the process with a report. The objects go to
# build/san, so that switching back and forth rebuilds neither tree (the programs are relinked).
SANITIZE ?= 0
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
ifeq ($(SANITIZE),1)
BUILD   := build/san
CFLAGS  += $(SAN_FLAGS)
LDLIBS  += $(SAN_FLAGS)
else
BUILD   := build
endif
# Extra include or library paths, e.g. a JSON library unpacked beside the tree (scripts/gpu_check.sh).
CFLAGS  += $(CFLAGS_EXTRA)
LDLIBS  += $(LDLIBS_EXTRA)

CUDA ?= 0
# MPI (several ranks, `mpirun -np N ./moe train ...`): on when mpicc is installed; MPI=0 builds a
# single-process moe without it.
MPI ?= $(if $(shell command -v mpicc 2>/dev/null),1,0)
ifeq ($(MPI),1)
CFLAGS  += -DMOE_MPI $(shell mpicc --showme:compile)
LDLIBS  += $(shell mpicc --showme:link)
DIST_SRC := $(wildcard src/dist/*.c)
else
DIST_SRC := $(filter-out src/dist/comm_mpi.c,$(wildcard src/dist/*.c))
endif
# NCCL joins CUDA builds: comm_nccl.c (and the device part of communication, src/dist/*.cu), else
# no_nccl.c.
ifeq ($(CUDA),1)
DIST_SRC := $(filter-out src/dist/no_nccl.c,$(DIST_SRC))
else
DIST_SRC := $(filter-out src/dist/comm_nccl.c,$(DIST_SRC))
endif

# Pictures of runs (`moe plot`) are drawn with cairo: on when pkg-config finds it (scripts/setup.sh
# installs libcairo2-dev); PLOT=0 builds moe without it (the command then says how to get it).
PLOT ?= $(if $(shell pkg-config --exists cairo 2>/dev/null && echo 1),1,0)
CAIRO_SRC := src/plot/plot.c src/plot/figures.c
ifeq ($(PLOT),1)
CFLAGS  += $(shell pkg-config --cflags cairo)
LDLIBS  += $(shell pkg-config --libs cairo)
PLOT_SRC := $(filter-out src/plot/no_plot.c,$(wildcard src/plot/*.c))
else
PLOT_SRC := $(filter-out $(CAIRO_SRC),$(wildcard src/plot/*.c))
endif

LIB_SRC  := $(wildcard src/common/*.c src/io/*.c src/text/*.c src/model/*.c src/ops/*.c src/ops/cpu/*.c src/train/*.c src/plan/*.c) \
            $(DIST_SRC) $(PLOT_SRC)

# CUDA backend (train.device=cuda): `make CUDA=1`, for Hopper (sm_90a) by default. NCCL and cuDNN
# from the toolkit, or NCCL_HOME / CUDNN_HOME (e.g. a Python wheel's nvidia/nccl, nvidia/cudnn).
# The header-only CUTLASS, the cuDNN frontend and NVML's header come from scripts/setup.sh (DEPS_INCLUDE).
NVCC ?= nvcc
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a
NVCCFLAGS ?= -O3 -lineinfo $(CUDA_ARCH)
NCCL_HOME ?= $(CUDA_HOME)
CUDNN_HOME ?= $(CUDA_HOME)
DEPS_INCLUDE ?= .deps/include
NVCCFLAGS += -std=c++17 -DNDEBUG -Isrc -I$(CUDNN_HOME)/include -isystem $(DEPS_INCLUDE) --expt-relaxed-constexpr -MMD -MP \
             -Xcompiler -Wall,-Wno-unused-parameter
lib_dirs = $(foreach d,$(1)/lib $(1)/lib64,-L$(d) -Wl,-rpath,$(d))
ifeq ($(CUDA),1)
ifeq ($(wildcard $(DEPS_INCLUDE)/cutlass/version.h),)
$(error CUTLASS headers missing in $(DEPS_INCLUDE): run scripts/setup.sh (it needs nvcc on PATH))
endif
ifeq ($(wildcard $(DEPS_INCLUDE)/nvml.h),)
$(error NVML's header missing in $(DEPS_INCLUDE): run scripts/setup.sh again (it needs nvcc on PATH))
endif
CFLAGS  += -DMOE_CUDA -I$(CUDA_HOME)/include -I$(NCCL_HOME)/include
LDLIBS  += $(call lib_dirs,$(NCCL_HOME)) -lnccl $(call lib_dirs,$(CUDNN_HOME)) -lcudnn
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lnvrtc -lcudart -lstdc++
CU_SRC  := $(wildcard src/ops/cuda/*.cu src/dist/*.cu)
endif
CLI_SRC  := $(wildcard src/cli/*.c)
TEST_SRC := $(wildcard tests/*.c)

CU_OBJ   := $(patsubst %.cu,$(BUILD)/cuda/%.o,$(CU_SRC))
F32_OBJ  := $(patsubst %.c,$(BUILD)/f32/%.o,$(LIB_SRC) $(CLI_SRC)) $(CU_OBJ)
LIB_OBJ  := $(filter-out $(BUILD)/f32/src/cli/%,$(F32_OBJ))
TEST_OBJ := $(patsubst %.c,$(BUILD)/f64/%.o,$(LIB_SRC) $(TEST_SRC))

DATA := data/tinyshakespeare_train.npy data/tinyshakespeare_val.npy

.PHONY: all test bench fuzz clean
all: moe $(DATA)

# Objects depend on the flags they were built with: switching CUDA=1 or MPI=0 rebuilds them.
# Programs depend on LINK_STAMP, which names the flags they were last linked with: switching
# SANITIZE relinks them from the other object tree.
FLAGS_HASH  := $(shell echo '$(CC) $(CFLAGS) $(NVCC) $(NVCCFLAGS) $(LDLIBS)' | md5sum | cut -c1-12)
FLAGS_STAMP := $(BUILD)/flags-$(FLAGS_HASH)
LINK_STAMP  := build/linked-$(FLAGS_HASH)
$(FLAGS_STAMP):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/flags-* && touch $@
$(LINK_STAMP):
	@mkdir -p build && rm -f build/linked-* && touch $@

moe: $(F32_OBJ) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

build/test_unit: $(TEST_OBJ) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

# Programs run under mpirun by tests/cli/test_mpi_comm.sh (float build, like ./moe).
build/test_comm: $(BUILD)/f32/tests/mpi/test_comm.o $(LIB_OBJ) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

# Size and colours of a PNG, for tests/cli/test_plot.sh (builds with cairo).
build/png_stats: $(BUILD)/f32/tests/plot/png_stats.o $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

$(BUILD)/f32/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# CUDA objects through scripts/nvcc_checked.sh, which reports where ptxas serialises a kernel's
# wgmma instructions and, for the grouped GEMMs' objects (wgmma main loops tuned to fit the
# registers), where a kernel spills: as warnings, or with PTXAS_CHECK=fail (CI) as errors.
PTXAS_CHECK ?= warn
$(patsubst %.cu,$(BUILD)/cuda/%.o,$(wildcard src/ops/cuda/cuda_grouped_sm90*.cu)): NVCC_CHECK_FLAGS := --no-spills
$(BUILD)/cuda/%.o: %.cu $(FLAGS_STAMP) scripts/nvcc_checked.sh
	@mkdir -p $(dir $@)
	NVCC="$(NVCC)" scripts/nvcc_checked.sh $(if $(filter fail,$(PTXAS_CHECK)),,--warn) $(NVCC_CHECK_FLAGS) \
		$(NVCCFLAGS) $(if $(filter 1,$(MPI)),-DMOE_MPI) -c $< -o $@

$(BUILD)/f64/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DMOE_F64 -Itests -c $< -o $@

$(DATA) &: data/tinyshakespeare.txt moe
	./moe data prepare data/tinyshakespeare.txt data/tinyshakespeare_train.npy \
		--val-out data/tinyshakespeare_val.npy --val-fraction 0.1

bench: build/bench_gemm

build/bench_gemm: $(addprefix $(BUILD)/f32/,bench/bench_gemm.o src/ops/cpu/cpu_gemm.o src/common/util.o) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

# The CUDA backend against the CPU one, on a GPU machine (make CUDA=1 build/test_cuda).
build/test_cuda: $(BUILD)/f32/tests/gpu/test_cuda.o $(LIB_OBJ) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

# Expert-exchange bandwidth across GPUs (mpirun -np 2 build/bench_exchange on a GPU machine).
build/bench_exchange: $(BUILD)/f32/bench/bench_exchange.o $(LIB_OBJ) $(LINK_STAMP)
	$(CC) -o $@ $(filter %.o,$^) $(LDLIBS)

# Sanitizer settings of the test run: leaks are errors; the own leaks of Open MPI and fontconfig (and
# only those) are suppressed by tests/lsan.supp.
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

test: moe build/test_unit $(if $(filter 1,$(MPI)),build/test_comm) $(if $(filter 1,$(PLOT)),build/png_stats) $(DATA)
	@$(if $(filter 1,$(SANITIZE)),$(SAN_ENV)) bash tests/run_all.sh

# libFuzzer harnesses (clang from Debian), each built with the library sources it reads through;
# `make fuzz FUZZ_SECONDS=N` runs each for N seconds from its seed corpus (tests/fuzz/corpus).
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 20
FUZZ_TARGETS := safetensors index config tokens tokenizer
FUZZ_CFLAGS  := -g -O1 -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Isrc -Itests/fuzz \
	-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
FUZZ_LIB     := src/common/util.c src/io/fsutil.c src/io/safetensors.c src/io/safetensors_index.c src/io/tokens.c \
	src/text/bpe.c src/text/tokenizer_load.c src/text/tokenizer_encode.c \
	src/model/config.c src/train/config.c src/dist/pipeline.c src/ops/no_cuda.c tests/fuzz/fuzz_common.c
FUZZ_BINS    := $(patsubst %,build/fuzz/fuzz_%,$(FUZZ_TARGETS))

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_LIB) tests/fuzz/fuzz.h
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $< $(FUZZ_LIB) -ljansson -lxxhash -lpcre2-8 -lm

fuzz: $(FUZZ_BINS)
	@bash tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

clean:
	rm -rf build moe $(DATA)

# Header dependencies of every object, the programs' own beside moe and test_unit included (a stale
# test_cuda.o against a changed ops.h would read the ops table at the wrong offsets).
PROG_OBJ := $(addprefix $(BUILD)/f32/,tests/mpi/test_comm.o tests/plot/png_stats.o tests/gpu/test_cuda.o \
            bench/bench_gemm.o bench/bench_exchange.o)
-include $(F32_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(PROG_OBJ:.o=.d)
