#!/usr/bin/env bash
# Configure and build into DIR (default build/) with extra CMake arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}; shift || true
# MPICH by default, whatever the system's "mpi" alternative points to (Open MPI may be installed
# too); GDN_MPICC selects another MPI's compiler wrapper.
mpicc=${GDN_MPICC:-$(command -v mpicc.mpich || command -v mpicc)}
mpi_args=(-DMPI_C_COMPILER="$mpicc")
case " $* " in *" -DGDN_MPI=OFF "*) mpi_args=() ;; esac # libgdncp alone: no MPI looked for
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "${mpi_args[@]}" "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)" >/dev/null
