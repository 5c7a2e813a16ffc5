/* gdp_bwd_v3.cu's kernels for K = 128, V = 64 (gdp_v3_split.h). */
#define GDP_V3_SPLIT
#define GDP_V3_PART_K 128
#define GDP_V3_PART_V 64
#include "../gdp_bwd_v3.cu"
