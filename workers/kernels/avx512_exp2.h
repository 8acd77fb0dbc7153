// 2^x in AVX-512 for the online softmax of our attention kernels. Include only where
// CPU_CAPABILITY_AVX512 is defined (the build is -march=native).
#pragma once

#include <immintrin.h>

namespace nalar_avx512 {

// 2^x for x <= 0 (or -inf, whose lanes the caller masks): x = n + f with n an integer and
// |f| <= 1/2, 2^f by its Taylor polynomial to degree 5 (relative error below 3e-6), and
// scalef to apply 2^n (which underflows to 0 instead of wrapping the exponent).
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln(2)^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace nalar_avx512
