/*
 * gdp_v3_split.h -- compiling gdp_fwd_v3.cu and gdp_bwd_v3.cu in parts.
 *
 * Each file instantiates all its kernels, for every (K, V) and n, through a few "root"
 * functions: per (K, n) in the forward (state_k64n2, prep_k64n2, ...), per (K, V) in the
 * backward (seq_k64v128, grad_k64v128, pair_k64v128, ...); the rest of the file calls the
 * roots by name.  Compiled whole, one nvcc process per file took 4 minutes or more here
 * and the build of the H200 machine's calls 6-8 (session 10): the longest step of every
 * device call.
 *
 * In parts (kernels/cuda/parts/, what CMake and tools/gpu_lab_build.sh build):
 *   *_main.cu   GDP_V3_SPLIT: the file with no roots defined -- its dispatchers and entry
 *               points call the roots through their declarations, so it instantiates no
 *               kernel and compiles in seconds;
 *   *_k<K>n<N>.cu (forward), *_k<K>v<V>.cu (backward)   GDP_V3_SPLIT, GDP_V3_PART_K and
 *               GDP_V3_PART_N or _V: the file defining only that part's roots (so
 *               compiling only its kernels) and none of the file's other external
 *               definitions (entry points, shared helpers), which the main part has.
 * The parts compile in parallel; linked together they hold the same code as the whole
 * file, which still builds alone (nothing defined: every root in it).
 */
#ifndef GDP_KERNELS_CUDA_V3_SPLIT_H
#define GDP_KERNELS_CUDA_V3_SPLIT_H

#if defined(GDP_V3_PART_K) && !defined(GDP_V3_SPLIT)
#error "gdp_v3_split.h: a part (GDP_V3_PART_K defined) needs GDP_V3_SPLIT defined too"
#endif

#endif
