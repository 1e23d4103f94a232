# moe.c build. `make` builds ./moe and the bundled tinyshakespeare token files; `make test` runs
# every test and ends with "N passed, N failed". Two builds share the sources: build/f32 (the
# program) and build/f64 (double precision, used by the unit tests for finite-difference checks).

CC      ?= cc
ARCH    ?= -march=native
CFLAGS  ?= -O3 $(ARCH) -g
CFLAGS  += -std=gnu11 -pthread -fopenmp -fno-math-errno -Wall -Wextra -Wno-unused-parameter -Isrc -MMD -MP
LDLIBS  += -pthread -fopenmp -ljansson -lm
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

LIB_SRC  := $(wildcard src/common/*.c src/io/*.c src/model/*.c src/ops/*.c src/ops/cpu/*.c src/train/*.c) $(DIST_SRC)

# CUDA backend (train.device=cuda): `make CUDA=1`, for Hopper (sm_90a) by default. NCCL and cuDNN
# from the toolkit, or NCCL_HOME / CUDNN_HOME (e.g. a Python wheel's nvidia/nccl, nvidia/cudnn).
# The header-only CUTLASS and cuDNN frontend come from scripts/setup.sh (DEPS_INCLUDE).
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
CFLAGS  += -DMOE_CUDA -I$(CUDA_HOME)/include -I$(NCCL_HOME)/include
LDLIBS  += $(call lib_dirs,$(NCCL_HOME)) -lnccl $(call lib_dirs,$(CUDNN_HOME)) -lcudnn
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lnvrtc -lcudart -lstdc++
CU_SRC  := $(wildcard src/ops/cuda/*.cu src/dist/*.cu)
endif
CLI_SRC  := $(wildcard src/cli/*.c)
TEST_SRC := $(wildcard tests/*.c)

CU_OBJ   := $(patsubst %.cu,build/cuda/%.o,$(CU_SRC))
F32_OBJ  := $(patsubst %.c,build/f32/%.o,$(LIB_SRC) $(CLI_SRC)) $(CU_OBJ)
TEST_OBJ := $(patsubst %.c,build/f64/%.o,$(LIB_SRC) $(TEST_SRC))

DATA := data/tinyshakespeare_train.npy data/tinyshakespeare_val.npy

.PHONY: all test bench clean
all: moe $(DATA)

moe: $(F32_OBJ)
	$(CC) -o $@ $^ $(LDLIBS)

build/test_unit: $(TEST_OBJ)
	$(CC) -o $@ $^ $(LDLIBS)

# Programs run under mpirun by tests/cli/test_mpi_comm.sh (float build, like ./moe).
build/test_comm: build/f32/tests/mpi/test_comm.o $(filter-out build/f32/src/cli/%,$(F32_OBJ))
	$(CC) -o $@ $^ $(LDLIBS)

# Objects depend on the flags they were built with: switching CUDA=1 or MPI=0 rebuilds them.
FLAGS_STAMP := build/flags-$(shell echo '$(CC) $(CFLAGS) $(NVCC) $(NVCCFLAGS) $(LDLIBS)' | md5sum | cut -c1-12)
$(FLAGS_STAMP):
	@mkdir -p build && rm -f build/flags-* && touch $@

build/f32/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

build/cuda/%.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(if $(filter 1,$(MPI)),-DMOE_MPI) -c $< -o $@

build/f64/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DMOE_F64 -Itests -c $< -o $@

$(DATA) &: data/tinyshakespeare.txt moe
	./moe data prepare data/tinyshakespeare.txt data/tinyshakespeare_train.npy \
		--val-out data/tinyshakespeare_val.npy --val-fraction 0.1

bench: build/bench_gemm

build/bench_gemm: build/f32/bench/bench_gemm.o build/f32/src/ops/cpu/cpu_gemm.o build/f32/src/common/util.o
	$(CC) -o $@ $^ $(LDLIBS)

# The CUDA backend against the CPU one, on a GPU machine (make CUDA=1 build/test_cuda).
build/test_cuda: build/f32/tests/gpu/test_cuda.o $(filter-out build/f32/src/cli/%,$(F32_OBJ))
	$(CC) -o $@ $^ $(LDLIBS)

# Expert-exchange bandwidth across GPUs (mpirun -np 2 build/bench_exchange on a GPU machine).
build/bench_exchange: build/f32/bench/bench_exchange.o $(filter-out build/f32/src/cli/%,$(F32_OBJ))
	$(CC) -o $@ $^ $(LDLIBS)

test: moe build/test_unit $(if $(filter 1,$(MPI)),build/test_comm) $(DATA)
	@bash tests/run_all.sh

clean:
	rm -rf build moe $(DATA)

-include $(F32_OBJ:.o=.d) $(TEST_OBJ:.o=.d)
