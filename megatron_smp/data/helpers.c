/* The per-sample loops of the dataset build, compiled at first use by
 * megatron_smp/data/compiled.py and called through ctypes (plain C: no Python headers, no
 * pybind11). Each function is the C twin of a numpy/Python path in megatron_smp/data/indices.py,
 * which stays the reference and the fallback; tests compare the two value for value.
 *
 * Built with -ffp-contract=off: the blending error `weight * i - drawn` must round twice,
 * as megatron-core's helpers.cpp and the Python path do, or float64 ties could break
 * differently.
 */
#include <stdint.h>

/* Sample i comes from the dataset with the largest weights[d] * max(i, 1) - drawn[d], ties
 * to the lowest d. `drawn` holds num_datasets zeros on entry and the draws on exit. */
void msmp_build_blending_indices(int16_t *dataset_index, int64_t *dataset_sample_index,
                                 const double *weights, int64_t *drawn, int32_t num_datasets,
                                 int64_t size) {
  for (int64_t sample = 0; sample < size; ++sample) {
    double scale = sample > 1 ? (double)sample : 1.0;
    int32_t best = 0;
    double best_error = weights[0] * scale - (double)drawn[0];
    for (int32_t dataset = 1; dataset < num_datasets; ++dataset) {
      double error = weights[dataset] * scale - (double)drawn[dataset];
      if (error > best_error) {
        best_error = error;
        best = dataset;
      }
    }
    dataset_index[sample] = (int16_t)best;
    dataset_sample_index[sample] = drawn[best];
    drawn[best] += 1;
  }
}

/* The same race over the datasets still short of limits[d]; sum(limits) samples. `active`
 * is scratch space for num_datasets int32, `drawn` num_datasets zeros. */
void msmp_build_exhaustive_blending_indices(int16_t *dataset_index,
                                            int64_t *dataset_sample_index,
                                            const double *weights, const int64_t *limits,
                                            int64_t *drawn, int32_t *active,
                                            int32_t num_datasets, int64_t size) {
  int32_t num_active = num_datasets;
  for (int32_t dataset = 0; dataset < num_datasets; ++dataset) active[dataset] = dataset;
  for (int64_t sample = 0; sample < size; ++sample) {
    double scale = sample > 1 ? (double)sample : 1.0;
    int32_t best = -1, best_slot = -1;
    double best_error = 0.0;
    for (int32_t slot = 0; slot < num_active; ++slot) { /* ascending: ties keep the lowest */
      int32_t dataset = active[slot];
      double error = weights[dataset] * scale - (double)drawn[dataset];
      if (best < 0 || error > best_error) {
        best_error = error;
        best = dataset;
        best_slot = slot;
      }
    }
    if (best < 0) return; /* nothing left: the caller checked sum(limits) == size */
    dataset_index[sample] = (int16_t)best;
    dataset_sample_index[sample] = drawn[best];
    drawn[best] += 1;
    if (drawn[best] == limits[best]) { /* keep `active` ascending */
      for (int32_t slot = best_slot; slot + 1 < num_active; ++slot) active[slot] = active[slot + 1];
      num_active -= 1;
    }
  }
}

/* Sum of sizes[document_index[k]] over k (the tokens of all epochs). */
#define MSMP_TOTAL_TOKENS(NAME, INDEX_T)                                                     \
  int64_t NAME(const int32_t *sizes, const INDEX_T *document_index, int64_t num_documents) { \
    int64_t total = 0;                                                                       \
    for (int64_t k = 0; k < num_documents; ++k) total += sizes[document_index[k]];           \
    return total;                                                                            \
  }
MSMP_TOTAL_TOKENS(msmp_total_tokens_i32, int32_t)
MSMP_TOTAL_TOKENS(msmp_total_tokens_i64, int64_t)

/* sample_index[2 * i] = the position k in document_index of the (non-empty) document holding
 * token i * seq_length - 1 + add_extra_token of the concatenation (the last token sample
 * i - 1 reads, as megatron-core's build_sample_idx places it), sample_index[2 * i + 1] =
 * i * seq_length minus that document's first token; entry 0 is (0, 0). The caller sized
 * num_samples so that every such token exists. */
#define MSMP_SAMPLE_INDEX(NAME, INDEX_T)                                                     \
  void NAME(int64_t *sample_index, const int32_t *sizes, const INDEX_T *document_index,      \
            int64_t num_documents, int64_t seq_length, int64_t num_samples,                  \
            int64_t add_extra_token) {                                                       \
    /* Document k spans tokens [start, end) of the concatenation. */                        \
    int64_t k = 0, start = 0;                                                                \
    int64_t end = num_documents > 0 ? sizes[document_index[0]] : 0;                          \
    sample_index[0] = 0;                                                                     \
    sample_index[1] = 0;                                                                     \
    for (int64_t i = 1; i <= num_samples; ++i) {                                             \
      int64_t position = i * seq_length, last_read = position - 1 + add_extra_token;         \
      while (end <= last_read && k < num_documents) {                                        \
        start = end;                                                                         \
        k += 1;                                                                              \
        if (k < num_documents) end += sizes[document_index[k]];                              \
      }                                                                                      \
      sample_index[2 * i] = k;                                                               \
      sample_index[2 * i + 1] = position - start;                                            \
    }                                                                                        \
  }
MSMP_SAMPLE_INDEX(msmp_build_sample_index_i32, int32_t)
MSMP_SAMPLE_INDEX(msmp_build_sample_index_i64, int64_t)
