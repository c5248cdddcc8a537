// Counter-based seeding: each (seed, epoch, sample) gets its own generator, so augmentation is
// the same whatever thread or rank processes the sample.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace imgtrain {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline std::mt19937_64 sample_rng(uint64_t seed, uint64_t epoch, uint64_t index) {
  return std::mt19937_64(splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ index));
}

// Uniform double in [a, b) from 53 random bits (std::uniform_real_distribution is not portable
// across standard libraries; this is).
inline double uniform(std::mt19937_64& g, double a, double b) {
  return a + (b - a) * (double(g() >> 11) * 0x1.0p-53);
}
// Uniform integer in [a, b] inclusive.
inline int64_t randint(std::mt19937_64& g, int64_t a, int64_t b) {
  return a + int64_t(g() % uint64_t(b - a + 1));
}

// The continuous draws timm makes (numpy's / random's distributions), as our own algorithms:
// the standard library's distributions differ between implementations, these do not.
double uniform01(std::mt19937_64& rng);  // [0, 1), 53 bits
double sample_gauss(double mean, double std, std::mt19937_64& rng);  // Box-Muller, no cached value
double sample_gamma(double shape, std::mt19937_64& rng);             // scale 1
double sample_beta(double a, double b, std::mt19937_64& rng);
std::vector<float> sample_dirichlet(double alpha, int n, std::mt19937_64& rng);  // as float32, as timm

}  // namespace imgtrain
