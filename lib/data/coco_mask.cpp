// COCO RLE masks, written from pycocotools' maskApi.c semantics (see coco_mask.h). Every function
// reproduces the C code's arithmetic step for step (32-bit unsigned counts, int pixel coordinates,
// double where it uses double) so results are bit-identical; where the C code has undefined
// behaviour or silently produces garbage (bad strings, counts that do not sum to h * w, masks of
// different sizes) we throw std::invalid_argument instead.
#include "data/coco_mask.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace imgtrain::coco {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// pycocotools keeps counts and h * w in 32-bit uints; larger masks cannot be represented.
uint64_t checked_area(uint32_t h, uint32_t w, const char* fn) {
  const uint64_t n = uint64_t(h) * w;
  if (n > std::numeric_limits<uint32_t>::max())
    fail(std::string(fn) + ": mask size " + std::to_string(h) + "x" + std::to_string(w) +
         " has more than 2^32-1 pixels (COCO RLE counts are 32-bit)");
  return n;
}

// The invariant every run walk below relies on (the C code loops forever or writes out of
// bounds without it): the runs cover the h * w mask exactly.
void check_rle(const Rle& r, const char* fn) {
  const uint64_t n = checked_area(r.h, r.w, fn);
  uint64_t sum = 0;
  for (uint32_t c : r.counts) sum += c;
  if (sum != n)
    fail(std::string(fn) + ": RLE counts sum to " + std::to_string(sum) + " but h*w is " +
         std::to_string(r.h) + "*" + std::to_string(r.w) + " = " + std::to_string(n));
}

// counts[i], or 0 past the end (maskApi reads cnts[0] unconditionally; only an empty mask has
// no counts, and for it 0 is what the walk needs).
uint32_t count_at(const std::vector<uint32_t>& c, size_t i) { return i < c.size() ? c[i] : 0; }

// A product rounded to double before any following addition. pycocotools' x86-64 build does
// not fuse a*b+c into an FMA; a build with -march=...+fma and -ffp-contract=fast would, and
// then disagree in the last bit. The volatile store keeps the compiler from contracting.
inline double mul(double a, double b) {
  volatile double p = a * b;
  return p;
}

// C's (int) cast of a double as x86-64 executes it (cvttsd2si): truncation toward zero, and
// INT_MIN for NaN or out of range. maskApi hits the NaN case on zero-length polygon edges
// (0.0 / 0) and stores the result as that point's y; the neighbours of such a point share its
// column, so it should never reach the mask, but the walk keeps the value as the C code has it.
int64_t x86_int(double v) {
  if (!(v > -2147483649.0 && v < 2147483648.0)) return std::numeric_limits<int32_t>::min();
  return int64_t(v);
}

uint64_t area_of(const Rle& r) {
  uint32_t a = 0;  // uint, as rleArea: it cannot overflow for a checked RLE
  for (size_t j = 1; j < r.counts.size(); j += 2) a += r.counts[j];
  return a;
}

// rleToBbox of the pycocotools 2.x line: skips empty foreground runs and widens to the full
// height when a run crosses a column. With no foreground (but at least one bg/fg pair) it keeps
// xs = w, xe = 0, so the width and height wrap around in uint, exactly as the C code returns.
Box bbox_of(const Rle& r) {
  const uint32_t h = r.h, w = r.w;
  const size_t m = r.counts.size() / 2 * 2;
  if (m == 0) return {0, 0, 0, 0};
  uint32_t xs = w, ys = h, xe = 0, ye = 0, cc = 0;
  for (size_t j = 0; j < m; j++) {
    const uint32_t start = cc;
    cc += r.counts[j];
    if (j % 2 == 0 || r.counts[j] == 0) continue;
    const uint32_t y_start = start % h, x_start = (start - y_start) / h;
    const uint32_t y_end = (cc - 1) % h, x_end = (cc - 1 - y_end) / h;
    xs = std::min(xs, x_start);
    xe = std::max(xe, x_end);
    if (x_start < x_end) {
      ys = 0;
      ye = h - 1;
    } else {
      ys = std::min(ys, y_start);
      ye = std::max(ye, y_end);
    }
  }
  return {double(xs), double(ys), double(uint32_t(xe - xs + 1)), double(uint32_t(ye - ys + 1))};
}

// One entry of bbIou.
double box_iou(const Box& d, const Box& g, bool crowd) {
  const double ga = mul(g[2], g[3]), da = mul(d[2], d[3]);
  const double w = std::fmin(d[2] + d[0], g[2] + g[0]) - std::fmax(d[0], g[0]);
  if (w <= 0) return 0;
  const double h = std::fmin(d[3] + d[1], g[3] + g[1]) - std::fmax(d[1], g[1]);
  if (h <= 0) return 0;
  const double i = mul(w, h);
  const double u = crowd ? da : da + ga - i;
  return i / u;
}

// ---- polygon rasterisation (rleFrPoly) ----
//
// maskApi upsamples the polygon 5x, walks every edge pixel by pixel into one long list of
// points (u, v), keeps the steps where u changes and whose x lands on a pixel centre after
// downsampling, and turns those "y boundaries" into runs. Only those steps matter, so instead
// of storing the walk (5 * perimeter points: gigabytes for large coordinates) we visit the
// same sequence lazily and jump over the parts that cannot produce a kept boundary. The kept
// boundaries are sorted afterwards, so the order we find them in does not matter.

struct Pt {
  int64_t u, v;
};

class PolyRaster {
 public:
  PolyRaster(uint32_t h, uint32_t w) : h_(h), w_(w), lo_(-10), hi_(5 * int64_t(w) + 10) {}

  // Appends the points of the edge from vertex (xs, ys) to (xe, ye), upsampled ints.
  void edge(int64_t xs, int64_t ys, int64_t xe, int64_t ye) {
    const int64_t dx = std::llabs(xe - xs), dy = std::llabs(ys - ye);
    const bool flip = (dx >= dy && xs > xe) || (dx < dy && ys > ye);
    if (flip) {
      std::swap(xs, xe);
      std::swap(ys, ye);
    }
    const bool along_x = dx >= dy;
    const double s = along_x ? double(ye - ys) / double(dx) : double(xe - xs) / double(dy);
    const int64_t n = along_x ? dx : dy;
    // The point at walk parameter t (maskApi's t: d or n - d when flipped).
    auto at = [&](int64_t t) -> Pt {
      if (along_x) return {t + xs, x86_int(double(ys) + mul(s, double(t)) + .5)};
      return {x86_int(double(xs) + mul(s, double(t)) + .5), t + ys};
    };
    // The walk goes d = 0..n; t = flip ? n - d : d.
    step(at(flip ? n : 0));
    // Steps between t-1 and t, visited in any order, each with its walk direction.
    auto pair = [&](int64_t t) {
      const Pt a = at(t - 1), b = at(t);
      if (flip) emit(b, a); else emit(a, b);
    };
    if (along_x) {
      // u = t + xs changes every step; a kept boundary needs min(u) = xs + t - 1 in [lo, hi].
      const int64_t t0 = std::max<int64_t>(1, lo_ - xs + 1), t1 = std::min<int64_t>(n, hi_ - xs + 1);
      for (int64_t t = t0; t <= t1; t++) pair(t);
    } else if (n > 0) {
      // u(t) is monotone in t (a rounded affine function), so the steps where it changes can be
      // found by bisection; only those whose u range meets [lo, hi] can be kept.
      const bool up = xe >= xs;
      auto key = [&](int64_t t) { return up ? at(t).u : -at(t).u; };
      const int64_t klo = up ? lo_ : -hi_, khi = up ? hi_ : -lo_;
      // first t with key >= klo
      int64_t a = 0, b = n + 1;
      while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (key(mid) >= klo) b = mid; else a = mid + 1;
      }
      if (a <= n) {
        int64_t t = std::max<int64_t>(a - 1, 0);
        while (t < n) {
          const int64_t kt = key(t);
          if (kt > khi || key(n) <= kt) break;
          int64_t l = t + 1, r = n;  // first t' > t with key(t') > key(t)
          while (l < r) {
            const int64_t mid = l + (r - l) / 2;
            if (key(mid) > kt) r = mid; else l = mid + 1;
          }
          pair(l);
          t = l;
        }
      }
    }
    have_prev_ = false;  // the edge's internal steps are done; continue from its last point
    step(at(flip ? 0 : n));
  }

  Rle finish() {
    // a: boundary positions plus the end, sorted, differenced; equal positions (two boundaries
    // at one pixel) cancel by folding the zero run and the next one into the previous.
    std::vector<uint32_t> a = std::move(points_);
    a.push_back(uint32_t(uint64_t(h_) * w_));
    std::sort(a.begin(), a.end());
    uint32_t p = 0;
    for (auto& x : a) {
      const uint32_t t = x;
      x -= p;
      p = t;
    }
    Rle r{h_, w_, {}};
    size_t j = 0;
    r.counts.push_back(a[j++]);
    while (j < a.size()) {
      if (a[j] > 0) {
        r.counts.push_back(a[j++]);
      } else {
        j++;
        if (j < a.size()) r.counts.back() += a[j++];
      }
    }
    return r;
  }

 private:
  // The next point of the walk, compared with the previous one.
  void step(const Pt& p) {
    if (have_prev_ && p.u != prev_.u) emit(prev_, p);
    prev_ = p;
    have_prev_ = true;
  }
  // A step from `prev` to `cur` where u changed: keep it if its x is a pixel column.
  void emit(const Pt& prev, const Pt& cur) {
    if (cur.u == prev.u) return;
    double xd = double(cur.u < prev.u ? cur.u : cur.u - 1);
    xd = (xd + .5) / 5 - .5;
    if (std::floor(xd) != xd || xd < 0 || xd > double(uint64_t(w_) - 1)) return;
    double yd = double(std::min(cur.v, prev.v));
    yd = (yd + .5) / 5 - .5;
    if (yd < 0) yd = 0;
    else if (yd > double(h_)) yd = h_;
    yd = std::ceil(yd);
    // int x * int h + int y in C, then (uint): the same bits as uint arithmetic
    points_.push_back(uint32_t(uint32_t(int64_t(xd)) * h_ + uint32_t(int64_t(yd))));
  }

  uint32_t h_, w_;
  int64_t lo_, hi_;  // the upsampled u range whose steps can land on a column (with margin)
  bool have_prev_ = false;
  Pt prev_{};
  std::vector<uint32_t> points_;
};

// rleFrPoly on k = n / 2 points.
Rle from_poly(const double* xy, size_t k, uint32_t h, uint32_t w, const char* fn) {
  const uint64_t area = checked_area(h, w, fn);
  // For an empty image maskApi returns garbage when w == 0; one run of nothing is the answer.
  if (area == 0) return Rle{h, w, {0}};
  std::vector<int64_t> x(k + 1), y(k + 1);
  for (size_t j = 0; j < k; j++) {
    for (int c = 0; c < 2; c++) {
      const double v = mul(5, xy[2 * j + c]) + .5;
      // C's (int) cast: out of range is undefined and pycocotools would walk billions of points
      if (!(v > -2147483649.0 && v < 2147483648.0))
        fail(std::string(fn) + ": polygon coordinate " + std::to_string(xy[2 * j + c]) +
             " is not finite or out of range");
      (c == 0 ? x : y)[j] = int64_t(v);
    }
  }
  PolyRaster r(h, w);
  if (k > 0) {
    x[k] = x[0];
    y[k] = y[0];
    for (size_t j = 0; j < k; j++) r.edge(x[j], y[j], x[j + 1], y[j + 1]);
  }
  return r.finish();
}

}  // namespace

Rle rle_encode(const uint8_t* mask, uint32_t h, uint32_t w) {
  const uint64_t n = checked_area(h, w, "rle_encode");
  Rle r{h, w, {}};
  uint8_t p = 0;
  uint32_t c = 0;
  for (uint64_t j = 0; j < n; j++) {
    const uint8_t b = mask[j] != 0;
    if (b != p) {
      r.counts.push_back(c);
      c = 0;
      p = b;
    }
    c++;
  }
  r.counts.push_back(c);
  return r;
}

std::vector<uint8_t> rle_decode(const Rle& r) {
  check_rle(r, "rle_decode");
  std::vector<uint8_t> m;
  m.reserve(size_t(r.h) * r.w);
  uint8_t v = 0;
  for (uint32_t c : r.counts) {
    m.insert(m.end(), c, v);
    v = !v;
  }
  return m;
}

Rle rle_merge(const std::vector<Rle>& rles, bool intersect) {
  if (rles.empty()) return Rle{};  // rleMerge: h = w = 0, no counts
  for (const auto& r : rles) check_rle(r, "rle_merge");
  const uint32_t h = rles[0].h, w = rles[0].w;
  for (const auto& r : rles)
    if (r.h != h || r.w != w)
      fail("rle_merge: masks of different sizes (" + std::to_string(h) + "x" + std::to_string(w) +
           " and " + std::to_string(r.h) + "x" + std::to_string(r.w) + ")");
  std::vector<uint32_t> cnts = rles[0].counts, out;
  // Fold the masks in one at a time, walking both run lists at once; a run ends in the output
  // whenever the combined value flips.
  for (size_t k = 1; k < rles.size(); k++) {
    const auto& A = cnts;
    const auto& B = rles[k].counts;
    out.clear();
    uint32_t ca = count_at(A, 0), cb = count_at(B, 0), cc = 0;
    bool v = false, va = false, vb = false;
    size_t a = 1, b = 1;
    uint64_t ct = 1;
    while (ct > 0) {
      const uint32_t c = std::min(ca, cb);
      cc += c;
      ct = 0;
      ca -= c;
      if (!ca && a < A.size()) {
        ca = A[a++];
        va = !va;
      }
      ct += ca;
      cb -= c;
      if (!cb && b < B.size()) {
        cb = B[b++];
        vb = !vb;
      }
      ct += cb;
      const bool vp = v;
      v = intersect ? (va && vb) : (va || vb);
      if (v != vp || ct == 0) {
        out.push_back(cc);
        cc = 0;
      }
    }
    std::swap(cnts, out);
  }
  return Rle{h, w, std::move(cnts)};
}

uint64_t rle_area(const Rle& r) {
  check_rle(r, "rle_area");
  return area_of(r);
}

Box rle_to_bbox(const Rle& r) {
  check_rle(r, "rle_to_bbox");
  return bbox_of(r);
}

Rle rle_from_bbox(const Box& bb, uint32_t h, uint32_t w) {
  // rleFrBbox: the box's four corners as a polygon
  const double xs = bb[0], xe = xs + bb[2], ys = bb[1], ye = ys + bb[3];
  const double xy[8] = {xs, ys, xs, ye, xe, ye, xe, ys};
  return from_poly(xy, 4, h, w, "rle_from_bbox");
}

Rle rle_from_polygon(const std::vector<double>& xy, uint32_t h, uint32_t w) {
  // frPoly reads int(len / 2) points: an odd last value is ignored
  return from_poly(xy.data(), xy.size() / 2, h, w, "rle_from_polygon");
}

Rle rle_from_polygons(const std::vector<std::vector<double>>& polys, uint32_t h, uint32_t w) {
  // frPyObjects decides by the first polygon: 4 values mean a list of boxes (which then fails
  // for a Python list of lists), fewer is rejected; the rest go through frPoly one by one.
  if (polys.empty()) fail("rle_from_polygons: no polygons");
  if (polys[0].size() <= 4)
    fail("rle_from_polygons: first polygon has " + std::to_string(polys[0].size()) +
         " coordinates; pycocotools' frPyObjects needs more than 4 (at least 3 points)");
  std::vector<Rle> rles;
  rles.reserve(polys.size());
  for (const auto& p : polys) {
    rles.push_back(from_poly(p.data(), p.size() / 2, h, w, "rle_from_polygons"));
  }
  return rle_merge(rles, false);
}

std::string rle_to_string(const Rle& r) {
  check_rle(r, "rle_to_string");
  // 5 payload bits per character, 0x20 = more follows, 0x10 of the last one = sign; offset by
  // '0'. From the fourth count on, the difference to the count two back is stored.
  std::string s;
  s.reserve(r.counts.size() * 2);
  for (size_t i = 0; i < r.counts.size(); i++) {
    int64_t x = r.counts[i];
    if (i > 2) x -= int64_t(r.counts[i - 2]);
    bool more = true;
    while (more) {
      int c = int(x & 0x1f);
      x >>= 5;  // arithmetic shift, as the C code's long
      more = (c & 0x10) ? x != -1 : x != 0;
      if (more) c |= 0x20;
      s.push_back(char(c + 48));
    }
  }
  return s;
}

Rle rle_from_string(std::string_view s, uint32_t h, uint32_t w) {
  checked_area(h, w, "rle_from_string");
  Rle r{h, w, {}};
  size_t p = 0;
  while (p < s.size()) {
    const size_t start = p;
    int64_t x = 0;
    int k = 0;
    bool more = true;
    while (more) {
      if (p >= s.size())
        fail("rle_from_string: truncated string (the last value at offset " + std::to_string(start) +
             " is unfinished)");
      const unsigned char ch = static_cast<unsigned char>(s[p]);
      if (ch < 48 || ch > 111)
        fail("rle_from_string: invalid character code " + std::to_string(int(ch)) + " at offset " +
             std::to_string(p) + " (expected '0'..'o')");
      // 7 groups hold 35 bits, enough for any difference of two 32-bit counts
      if (k == 7) fail("rle_from_string: value at offset " + std::to_string(start) + " is too long");
      const int c = ch - 48;
      x |= int64_t(c & 0x1f) << (5 * k);
      more = c & 0x20;
      p++;
      k++;
      if (!more && (c & 0x10)) x |= -(int64_t(1) << (5 * k));  // sign-extend
    }
    if (r.counts.size() > 2) x += r.counts[r.counts.size() - 2];
    if (x < 0 || x > int64_t(std::numeric_limits<uint32_t>::max()))
      fail("rle_from_string: run " + std::to_string(r.counts.size()) + " has length " + std::to_string(x) +
           " (out of range)");
    r.counts.push_back(uint32_t(x));
  }
  check_rle(r, "rle_from_string");
  return r;
}

Rle rle_from_counts(std::vector<uint32_t> counts, uint32_t h, uint32_t w) {
  Rle r{h, w, std::move(counts)};
  check_rle(r, "rle_from_counts");
  return r;
}

void rle_iou(const std::vector<Rle>& dt, const std::vector<Rle>& gt, const std::vector<uint8_t>& iscrowd,
             double* out) {
  if (!iscrowd.empty() && iscrowd.size() != gt.size())
    fail("rle_iou: iscrowd has " + std::to_string(iscrowd.size()) + " entries for " +
         std::to_string(gt.size()) + " ground truths");
  std::vector<Box> db(dt.size()), gb(gt.size());
  for (size_t d = 0; d < dt.size(); d++) {
    check_rle(dt[d], "rle_iou");
    db[d] = bbox_of(dt[d]);
  }
  for (size_t g = 0; g < gt.size(); g++) {
    check_rle(gt[g], "rle_iou");
    gb[g] = bbox_of(gt[g]);
  }
  const size_t n = gt.size();
  for (size_t d = 0; d < dt.size(); d++) {
    for (size_t g = 0; g < n; g++) {
      const bool crowd = !iscrowd.empty() && iscrowd[g];
      // rleIou: the boxes' IoU first; only overlapping boxes get the run walk
      double o = box_iou(db[d], gb[g], crowd);
      if (o > 0) {
        const Rle& A = dt[d];
        const Rle& B = gt[g];
        if (A.h != B.h || A.w != B.w) {
          o = -1;
        } else {
          // intersection and union in one walk over both run lists, O(runs)
          uint32_t ca = count_at(A.counts, 0), cb = count_at(B.counts, 0), i = 0, u = 0;
          bool va = false, vb = false;
          size_t a = 1, b = 1;
          uint64_t ct = 1;
          while (ct > 0) {
            const uint32_t c = std::min(ca, cb);
            if (va || vb) {
              u += c;
              if (va && vb) i += c;
            }
            ct = 0;
            ca -= c;
            if (!ca && a < A.counts.size()) {
              ca = A.counts[a++];
              va = !va;
            }
            ct += ca;
            cb -= c;
            if (!cb && b < B.counts.size()) {
              cb = B.counts[b++];
              vb = !vb;
            }
            ct += cb;
          }
          if (i == 0) u = 1;
          else if (crowd) u = uint32_t(area_of(A));  // a crowd gt: the union is the detection
          o = double(i) / double(u);
        }
      }
      out[d * n + g] = o;
    }
  }
}

void bbox_iou(const std::vector<Box>& dt, const std::vector<Box>& gt, const std::vector<uint8_t>& iscrowd,
              double* out) {
  if (!iscrowd.empty() && iscrowd.size() != gt.size())
    fail("bbox_iou: iscrowd has " + std::to_string(iscrowd.size()) + " entries for " +
         std::to_string(gt.size()) + " ground truths");
  const size_t n = gt.size();
  for (size_t d = 0; d < dt.size(); d++)
    for (size_t g = 0; g < n; g++) out[d * n + g] = box_iou(dt[d], gt[g], !iscrowd.empty() && iscrowd[g]);
}

}  // namespace imgtrain::coco
