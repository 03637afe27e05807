# Reads megatron's --result-rejected-tracker-filename (one line per result its rerun state machine
# rejected: "ts=... node=N device=D jobID=J rank=R iteration=I status=RerunValidationStatus.S
# result=... message=...") and prints the iterations the next start of megatron-core 0.19.2
# skips, one per line, ascending: those one rank failed twice (statuses RERUN_DISABLED,
# FIRST_RERUN_REPRODUCIBLE, SECOND_RERUN_REPRODUCIBLE), unless a job failed them on several ranks
# ("Will not skip these iterations due to multiple rank errors"). train.sh requeues a job that
# megatron stopped on result validation only when its iteration is among them: otherwise the next
# attempt would rerun the same batch and stop the same way, again and again.
#   awk -f examples/moe/rejected_results.awk FILE
# With -v verdict_after=N it prints instead what megatron decided in the lines after line N (one
# attempt's): "STATUS ITERATION NODE" of the last that reproduced a NaN/Inf (STATUS
# FIRST_RERUN_REPRODUCIBLE: it exited 16; SECOND_RERUN_REPRODUCIBLE: 17), or nothing; after a 17,
# a fourth field: the node that reproduced that iteration's NaN/Inf in place (its 16), if any;
# after a 16, the node where an earlier attempt reproduced it in place too, if any (Megatron-FSDP:
# fsdp_dtensor checkpoints keep no rerun state, so a rerun on another node exits 16 again).
function field(name) {  # the value of " name=value" on this line, "" if none
  if (!match($0, " " name "=[^ ]*")) return ""
  return substr($0, RSTART + length(name) + 2, RLENGTH - length(name) - 2)
}
{
  status = field("status")
  sub(/.*\./, "", status)
  status = toupper(status)
  if (verdict_after != "") {
    if (!/ message=.found (NaN|Inf) /) next
    iteration = field("iteration")
    if (status == "FIRST_RERUN_REPRODUCIBLE") {
      if (NR <= verdict_after) earlier_node[iteration] = field("node")
      first_node[iteration] = field("node")
    }
    if (NR > verdict_after &&
        (status == "FIRST_RERUN_REPRODUCIBLE" || status == "SECOND_RERUN_REPRODUCIBLE"))
      verdict = status " " iteration " " field("node") \
                (status == "SECOND_RERUN_REPRODUCIBLE" ? " " first_node[iteration] : \
                 iteration in earlier_node ? " " earlier_node[iteration] : "")
    next
  }
  if (status != "RERUN_DISABLED" && status != "FIRST_RERUN_REPRODUCIBLE" &&
      status != "SECOND_RERUN_REPRODUCIBLE") next
  job = field("jobID"); rank = field("rank"); iteration = field("iteration")
  if (rank !~ /^[0-9]+$/ || iteration !~ /^[0-9]+$/) next
  iteration += 0
  if (++failures[rank SUBSEP iteration] == 2) twice[iteration] = 1
  if (!((job, iteration, rank) in rank_seen)) {
    rank_seen[job, iteration, rank] = 1
    if (++ranks_in_job[job, iteration] > 1) several_ranks[iteration] = 1
  }
}
END {
  if (verdict_after != "") {
    if (verdict != "") print verdict
    exit
  }
  n = 0
  for (iteration in twice)
    if (!(iteration in several_ranks)) skipped[++n] = iteration + 0
  for (i = 2; i <= n; i++)  # insertion sort: POSIX awk has no sort
    for (j = i; j > 1 && skipped[j - 1] > skipped[j]; j--) {
      t = skipped[j]; skipped[j] = skipped[j - 1]; skipped[j - 1] = t
    }
  for (i = 1; i <= n; i++) print skipped[i]
}
