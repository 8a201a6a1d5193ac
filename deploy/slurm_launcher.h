// Deployments inside a Slurm allocation (deploy/slurm/): `tandem launch --slurm FILE`, run by the
// job script on the first node of the compute pool, reads the placement from Slurm's environment
// and starts the memory ranks with `srun` instead of ssh (launch.remote: srun).
//
// A heterogeneous job has the compute pool as het group 0 and the memory pool as het group 1
// (SLURM_JOB_NODELIST_HET_GROUP_1, SLURM_TASKS_PER_NODE_HET_GROUP_1): one memory rank per task of
// group 1, on the nodes Slurm placed them. A plain (one-group) job runs compute rank 0 on the
// launcher's node and the memory ranks as the tasks of the whole allocation.
//
// Each memory rank is its own step, `srun --het-group=1 --nodes=1 --ntasks=1 --exact
// --nodelist=NODE tandem memory ... --stdin-bootstrap`: srun forwards the launcher's stdin pipe (the
// secret and config, deploy/ssh_launcher.h) and the rank's output back into its log, and a rank
// dies with its srun, which dies with the launcher (PR_SET_PDEATHSIG); Slurm ends the steps with
// the job anyway.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

// The --set overrides that describe the allocation: memory.hosts (each node of the memory pool with
// one device per task: `cpu`, or with launch.slurm_devices gpu `cuda:0`, `cuda:1`, ... per node)
// and launch.remote=srun. `devices` is launch.slurm_devices. Errors name the missing or malformed
// Slurm variable. Node addresses come from `scontrol show node` (NodeAddr).
absl::StatusOr<std::vector<std::string>> SlurmOverrides(const std::string& devices);

// srun's argv for one memory rank on `node` (the het group when the job is heterogeneous).
std::vector<std::string> SrunArgv(const std::string& node, const std::vector<std::string>& rank_argv);

}  // namespace tandem
