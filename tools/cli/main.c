/* main.c - the `lmloss` command: check, bench, collapse. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static void usage(FILE *f) {
  fprintf(f, "usage: lmloss <command> [options]\n"
             "\n"
             "commands:\n"
             "  check [--cpu-only]   run every op on every available backend (CPU, and CUDA\n"
             "                       when there is a GPU) against the float64 reference, on\n"
             "                       random and on peaked rows, fp32 and bf16; prints a\n"
             "                       pass/fail table; exit status 1 on any failure\n"
             "  bench [OP...] [--device cpu|cuda] [--shape N,V[,H]] [--dtype f32|bf16|f16]\n"
             "        [--threads T] [--reps R] [--queue Q] [--plain] [--supervised F] [--csv]\n"
             "                       time ops and compare each with the machine's limit\n"
             "                       measured in the same run (CPU: a read+exp pass over the\n"
             "                       logits, and the teacher's for kl, reverse-kl, jsd and\n"
             "                       tvd; CUDA: device copy bandwidth; fused head: its\n"
             "                       three GEMMs alone). Cases carry label smoothing, z-loss,\n"
             "                       20%% ignored rows, K = 2 and an entropy gradient; --plain\n"
             "                       drops them (K = 1). --supervised F: the CE ops ignore all\n"
             "                       but a fraction F of the rows, spread evenly (the limits\n"
             "                       stay those of all rows). --queue Q (CUDA): each timed\n"
             "                       sample is Q calls queued back to back (the limit's too),\n"
             "                       per call; at 1 (default) each call's host time before its\n"
             "                       first kernel counts. OPs (default: all):\n"
             "                       ");
  for (int o = 0; o < OP_COUNT; o++)
    fprintf(f, "%s%s", cli_op_name((cli_op)o), o + 1 < OP_COUNT ? ", " : "\n");
  fprintf(f, "                       Default shapes: CPU 4096,32768 (fused head 1024,32768,1024);\n"
             "                       CUDA 8192,152064 (fused head 8192,152064,4096).\n"
             "  collapse             show softmax collapse: a confident token's loss and\n"
             "                       gradient, the usual fp32 way vs lmloss vs float64\n"
             "  --help               this text (also after a command)\n"
             "  --version            the command's and the library's version\n"
             "\n"
             "examples:\n"
             "  lmloss check\n"
             "  lmloss bench logprob ce-grad --shape 4096,32768 --threads 2\n"
             "  lmloss bench linear-ce --device cuda --dtype bf16 --csv\n");
}

/* This command's version (the header it was built with) and the loaded
 * library's, which differ when an older or newer liblmloss is found. */
static void version(void) {
  const int v = lmloss_version();
  printf("lmloss %d.%d.%d (library %d.%d.%d, CPU ISA %s, CUDA %s)\n", LMLOSS_VERSION_MAJOR,
         LMLOSS_VERSION_MINOR, LMLOSS_VERSION_PATCH, v / 10000, v / 100 % 100, v % 100,
         lmloss_cpu_isa(), lmloss_has_cuda() ? "built in" : "not built in");
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
      !strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (int a = 1; a < argc; a++) { /* anywhere: `lmloss bench --version` too */
    if (!strcmp(argv[a], "--version")) return version(), 0;
    if (a > 1 && (!strcmp(argv[a], "--help") || !strcmp(argv[a], "-h"))) return usage(stdout), 0;
  }
  if (!strcmp(argv[1], "check")) return cmd_check(argc - 1, argv + 1);
  if (!strcmp(argv[1], "bench")) return cmd_bench(argc - 1, argv + 1);
  if (!strcmp(argv[1], "collapse")) return cmd_collapse(argc - 1, argv + 1);
  fprintf(stderr, "lmloss: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
