/* attend.h with AVX-512 (F16C for halves, byte-to-float widening in one instruction). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,f16c")
#define ATTEND attend_avx512
#include "attend.h"
#endif
