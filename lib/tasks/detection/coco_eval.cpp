#include "tasks/detection/coco_eval.h"

#include "core/error.h"
#include "core/parallel.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <exception>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

namespace imgtrain::coco {

std::vector<double> EvalParams::default_iou_thrs() {
  // np.linspace(.5, 0.95, 10): i * step + .5 with step = (0.95 - .5) / 9, the last set to 0.95.
  // Written out as numpy's doubles so that no compiler contraction (fma) can change them.
  return {0x1.0000000000000p-1, 0x1.199999999999ap-1, 0x1.3333333333333p-1, 0x1.4cccccccccccdp-1,
          0x1.6666666666666p-1, 0x1.8000000000000p-1, 0x1.999999999999ap-1, 0x1.b333333333333p-1,
          0x1.cccccccccccccp-1, 0x1.e666666666666p-1};
}

std::vector<double> EvalParams::default_rec_thrs() {
  // np.linspace(0, 1, 101): i * 0.01 (+ 0.0), the last set to 1.0
  std::vector<double> r(101);
  for (int i = 0; i < 100; ++i) r[size_t(i)] = double(i) * 0.01;
  r[100] = 1.0;
  return r;
}

// numpy's pairwise_sum for float64 (8 accumulators up to 128 elements, halves above), which
// np.mean / np.add.reduce use on a contiguous array.
static double pairwise_sum(const double* a, size_t n) {
  if (n < 8) {
    double res = 0.;
    for (size_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (size_t j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (size_t j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

double numpy_mean(const double* v, size_t n) {
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  return pairwise_sum(v, n) / double(n);
}

namespace {

// Per-detection result bits of evaluateImg at one (area range, IoU threshold).
constexpr uint8_t kMatched = 1;  // dtMatches != 0 (matched to a gt whose id is not 0)
constexpr uint8_t kIgnored = 2;  // dtIgnore

// Annotation indices grouped by (category, image) cell = k * I + i, in file order (CSR).
struct Cells {
  std::vector<uint32_t> start;  // size cells + 1
  std::vector<uint32_t> items;
};

template <typename Key>
Cells group(size_t n_cells, const std::vector<Annotation>& anns, Key&& key) {
  Cells c;
  c.start.assign(n_cells + 1, 0);
  std::vector<int64_t> cell(anns.size());
  for (size_t j = 0; j < anns.size(); ++j) {
    cell[j] = key(anns[j]);
    if (cell[j] >= 0) ++c.start[size_t(cell[j]) + 1];
  }
  for (size_t i = 0; i < n_cells; ++i) c.start[i + 1] += c.start[i];
  c.items.resize(c.start[n_cells]);
  std::vector<uint32_t> fill(c.start.begin(), c.start.end() - 1);
  for (size_t j = 0; j < anns.size(); ++j)
    if (cell[j] >= 0) c.items[fill[size_t(cell[j])]++] = uint32_t(j);
  return c;
}

// Reused buffers of one worker thread: no allocation per cell once they have grown.
struct Scratch {
  std::vector<Box> dbox, gbox;
  std::vector<Rle> drle, grle;
  std::vector<uint8_t> crowd;
  std::vector<double> ious;
  std::vector<uint32_t> order;
  std::vector<uint8_t> g_ig, g_crowd, g_idnz, g_matched, d_out;
};

struct Sorted {
  double score;
  uint32_t slot;
};

// parallel_for that hands the first exception of any worker to the caller (a bad mask, say)
// instead of terminating.
template <typename Fn>
void parallel_for_rethrow(size_t n, size_t threads, Fn&& fn) {
  std::exception_ptr first;
  std::mutex mu;
  parallel_for(n, threads, [&](size_t i) {
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!first) first = std::current_exception();
    }
  });
  if (first) std::rethrow_exception(first);
}

}  // namespace

EvalResult evaluate(const Dataset& gt, const Dataset& dt, const EvalParams& params) {
  EvalResult res;
  res.params = params;
  EvalParams& p = res.params;
  res.iou_type = p.iou_type;
  std::sort(p.max_dets.begin(), p.max_dets.end());
  if (p.max_dets.empty()) throw std::invalid_argument("coco evaluate: max_dets is empty");
  if (p.area_rng.size() != p.area_lbl.size())
    throw std::invalid_argument("coco evaluate: area_rng and area_lbl differ in length");
  const size_t threads = p.threads ? p.threads : std::max(1u, std::thread::hardware_concurrency());

  // Params.imgIds / catIds: the gt's, sorted and unique
  for (auto& im : gt.images) res.img_ids.push_back(im.id);
  for (auto& c : gt.categories) res.cat_ids.push_back(c.id);
  for (auto* v : {&res.img_ids, &res.cat_ids}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const size_t I = res.img_ids.size(), K = res.cat_ids.size();
  const size_t T = p.iou_thrs.size(), R = p.rec_thrs.size(), A = p.area_rng.size(), M = p.max_dets.size();
  res.T = T, res.R = R, res.K = K, res.A = A, res.M = M;
  std::unordered_map<int64_t, uint32_t> img_pos, cat_pos;
  img_pos.reserve(I);
  for (size_t i = 0; i < I; ++i) img_pos.emplace(res.img_ids[i], uint32_t(i));
  for (size_t k = 0; k < K; ++k) cat_pos.emplace(res.cat_ids[k], uint32_t(k));
  const size_t n_cells = I * K;
  auto cell_of = [&](const Annotation& a) -> int64_t {
    auto i = img_pos.find(a.image_id);
    auto k = cat_pos.find(a.category_id);
    if (i == img_pos.end() || k == cat_pos.end()) return -1;  // getAnnIds(imgIds, catIds) drops it
    return int64_t(k->second) * int64_t(I) + i->second;
  };
  const Cells gcells = group(n_cells, gt.annotations, cell_of);
  Cells dcells = group(n_cells, dt.annotations, cell_of);

  // Detections of each cell: highest score first (stable, as np.argsort(-score, 'mergesort')),
  // cut at the largest maxDet. A slot is one kept detection; a cell's slots are contiguous.
  const size_t max_det = size_t(p.max_dets.back());
  std::vector<uint32_t> slot_start(n_cells + 1, 0);
  for (size_t c = 0; c < n_cells; ++c) {
    auto b = dcells.items.begin() + dcells.start[c], e = dcells.items.begin() + dcells.start[c + 1];
    if (e - b > 1)
      std::stable_sort(b, e, [&](uint32_t x, uint32_t y) { return dt.annotations[x].score > dt.annotations[y].score; });
    slot_start[c + 1] = slot_start[c] + uint32_t(std::min<size_t>(size_t(e - b), max_det));
  }
  const size_t S = slot_start[n_cells];
  std::vector<double> slot_score(S);
  std::vector<uint8_t> flags(A * T * S);  // [a][t][slot]

  // evaluateImg for every (category, image) cell and area range.
  std::vector<double> thr(T);
  for (size_t t = 0; t < T; ++t) thr[t] = std::min(p.iou_thrs[t], 1 - 1e-10);
  const bool segm = p.iou_type == IouType::segm;
  auto eval_cell = [&](size_t c, Scratch& s) {
    const uint32_t* g_idx = gcells.items.data() + gcells.start[c];
    const size_t G = gcells.start[c + 1] - gcells.start[c];
    const uint32_t* d_idx = dcells.items.data() + dcells.start[c];
    const size_t D = slot_start[c + 1] - slot_start[c];
    if (G == 0 && D == 0) return;
    const uint32_t slot0 = slot_start[c];
    for (size_t d = 0; d < D; ++d) slot_score[slot0 + d] = dt.annotations[d_idx[d]].score;

    // computeIoU: [D x G], gts in file order
    s.ious.resize(D * G);
    if (G && D) {
      s.crowd.resize(G);
      for (size_t g = 0; g < G; ++g) s.crowd[g] = gt.annotations[g_idx[g]].iscrowd;
      if (segm) {
        const Image* im = gt.image(res.img_ids[c % I]);
        s.grle.resize(G);
        s.drle.resize(D);
        for (size_t g = 0; g < G; ++g) s.grle[g] = ann_to_rle(gt.annotations[g_idx[g]], im->height, im->width);
        for (size_t d = 0; d < D; ++d) s.drle[d] = ann_to_rle(dt.annotations[d_idx[d]], im->height, im->width);
        rle_iou(s.drle, s.grle, s.crowd, s.ious.data());
      } else {
        s.gbox.resize(G);
        s.dbox.resize(D);
        for (size_t g = 0; g < G; ++g) s.gbox[g] = gt.annotations[g_idx[g]].bbox;
        for (size_t d = 0; d < D; ++d) s.dbox[d] = dt.annotations[d_idx[d]].bbox;
        bbox_iou(s.dbox, s.gbox, s.crowd, s.ious.data());
      }
    }
    s.order.resize(G);
    s.g_ig.resize(G);
    s.g_crowd.resize(G);
    s.g_idnz.resize(G);
    s.g_matched.resize(G);
    s.d_out.resize(D);
    for (size_t a = 0; a < A; ++a) {
      const double lo = p.area_rng[a][0], hi = p.area_rng[a][1];
      // gts sorted ignore-last (stable): the regular ones, then the ignored, each in file order
      size_t n = 0;
      for (int pass = 0; pass < 2; ++pass)
        for (size_t g = 0; g < G; ++g) {
          const Annotation& ga = gt.annotations[g_idx[g]];
          const bool ig = ga.iscrowd || ga.area < lo || ga.area > hi;
          if (ig != bool(pass)) continue;
          s.order[n] = uint32_t(g);
          s.g_ig[n] = ig;
          s.g_crowd[n] = ga.iscrowd;
          s.g_idnz[n] = ga.id != 0;  // dtMatches holds the gt id: a match to id 0 reads as none
          ++n;
        }
      for (size_t d = 0; d < D; ++d) {
        const double ar = dt.annotations[d_idx[d]].area;
        s.d_out[d] = ar < lo || ar > hi;
      }
      for (size_t t = 0; t < T; ++t) {
        uint8_t* f = flags.data() + (a * T + t) * S + slot0;
        std::fill(s.g_matched.begin(), s.g_matched.end(), 0);
        for (size_t d = 0; d < D; ++d) {
          uint8_t matched = 0, ignored = 0;
          if (G) {
            const double* row = s.ious.data() + d * G;
            double best = thr[t];
            ptrdiff_t m = -1;
            for (size_t g = 0; g < G; ++g) {
              if (s.g_matched[g] && !s.g_crowd[g]) continue;  // taken, and not a crowd
              if (m > -1 && !s.g_ig[size_t(m)] && s.g_ig[g]) break;  // have a regular match: stop at the ignored
              const double v = row[s.order[g]];
              if (v < best) continue;
              best = v;  // ties go to the later gt, as in pycocotools
              m = ptrdiff_t(g);
            }
            if (m > -1) {
              ignored = s.g_ig[size_t(m)];
              matched = s.g_idnz[size_t(m)];
              s.g_matched[size_t(m)] = 1;  // gtMatches holds the dt id, always >= 1
            }
          }
          // unmatched detections outside the area range are ignored
          if (!matched && s.d_out[d]) ignored = 1;
          f[d] = uint8_t((matched ? kMatched : 0) | (ignored ? kIgnored : 0));
        }
      }
    }
  };
  {
    std::vector<uint32_t> work;  // cells with something in them
    for (size_t c = 0; c < n_cells; ++c)
      if (gcells.start[c + 1] > gcells.start[c] || slot_start[c + 1] > slot_start[c]) work.push_back(uint32_t(c));
    const size_t chunk = 64, n_chunks = (work.size() + chunk - 1) / chunk;
    parallel_for_rethrow(n_chunks, threads, [&](size_t ch) {
      thread_local Scratch s;
      for (size_t w = ch * chunk; w < std::min(work.size(), (ch + 1) * chunk); ++w) eval_cell(work[w], s);
    });
  }

  // npig per (category, area): gts that are neither crowd nor outside the range
  std::vector<size_t> npig(K * A, 0);
  for (size_t c = 0; c < n_cells; ++c)
    for (uint32_t j = gcells.start[c]; j < gcells.start[c + 1]; ++j) {
      const Annotation& ga = gt.annotations[gcells.items[j]];
      for (size_t a = 0; a < A; ++a)
        if (!(ga.iscrowd || ga.area < p.area_rng[a][0] || ga.area > p.area_rng[a][1])) ++npig[(c / I) * A + a];
    }

  // accumulate, one category per task
  res.precision.assign(T * R * K * A * M, -1.0);
  res.recall.assign(T * K * A * M, -1.0);
  res.scores.assign(T * R * K * A * M, -1.0);
  const double eps = std::nextafter(1.0, 2.0) - 1.0;  // np.spacing(1)
  parallel_for_rethrow(K, threads, [&](size_t k) {
    std::vector<Sorted> dts;
    std::vector<double> rc, pr;
    for (size_t m = 0; m < M; ++m) {
      const size_t md = size_t(std::max(0, p.max_dets[m]));
      dts.clear();
      for (size_t i = 0; i < I; ++i) {
        const size_t c = k * I + i, n = std::min<size_t>(slot_start[c + 1] - slot_start[c], md);
        for (size_t d = 0; d < n; ++d) dts.push_back({slot_score[slot_start[c] + d], uint32_t(slot_start[c] + d)});
      }
      // np.argsort(-dtScores, kind='mergesort'): stable, images in id order, then per-image order
      std::stable_sort(dts.begin(), dts.end(), [](const Sorted& x, const Sorted& y) { return x.score > y.score; });
      const size_t nd = dts.size();
      rc.resize(nd);
      pr.resize(nd);
      for (size_t a = 0; a < A; ++a) {
        const size_t np_ig = npig[k * A + a];
        if (np_ig == 0) continue;
        for (size_t t = 0; t < T; ++t) {
          const uint8_t* f = flags.data() + (a * T + t) * S;
          size_t tp = 0, fp = 0;
          for (size_t j = 0; j < nd; ++j) {
            const uint8_t b = f[dts[j].slot];
            if (!(b & kIgnored)) {
              if (b & kMatched) ++tp;
              else ++fp;
            }
            rc[j] = double(tp) / double(np_ig);
            pr[j] = double(tp) / (double(fp) + double(tp) + eps);
          }
          res.recall[((t * K + k) * A + a) * M + m] = nd ? rc[nd - 1] : 0;
          for (size_t j = nd; j-- > 1;)  // precision made monotone from the right
            if (pr[j] > pr[j - 1]) pr[j - 1] = pr[j];
          for (size_t r = 0; r < R; ++r) {
            const size_t idx = ((((t * R + r) * K + k) * A + a) * M + m);
            // np.searchsorted(rc, recThrs, side='left'); past the end the rest stays 0
            const size_t pi = size_t(std::lower_bound(rc.begin(), rc.end(), p.rec_thrs[r]) - rc.begin());
            if (pi >= nd) {
              for (size_t r2 = r; r2 < R; ++r2) {
                const size_t i2 = ((((t * R + r2) * K + k) * A + a) * M + m);
                res.precision[i2] = 0;
                res.scores[i2] = 0;
              }
              break;
            }
            res.precision[idx] = pr[pi];
            res.scores[idx] = dts[pi].score;
          }
        }
      }
    }
  });

  // summarize: means over the entries > -1, in C order
  std::vector<double> buf;
  auto summarize = [&](bool ap, double iou_thr, bool all_thr, const std::string& area, int max_dets) {
    buf.clear();
    std::vector<size_t> ts, as, ms;
    for (size_t t = 0; t < T; ++t)
      if (all_thr || p.iou_thrs[t] == iou_thr) ts.push_back(t);
    for (size_t a = 0; a < A; ++a)
      if (p.area_lbl[a] == area) as.push_back(a);
    for (size_t m = 0; m < M; ++m)
      if (p.max_dets[m] == max_dets) ms.push_back(m);
    // s[:, :, :, aind, mind] pairs aind with mind (numpy's advanced indexing)
    const size_t pairs = std::min(as.size(), ms.size());
    for (size_t t : ts) {
      if (ap) {
        for (size_t r = 0; r < R; ++r)
          for (size_t k = 0; k < K; ++k)
            for (size_t q = 0; q < pairs; ++q) {
              const double v = res.precision_at(t, r, k, as[q], ms[q]);
              if (v > -1) buf.push_back(v);
            }
      } else {
        for (size_t k = 0; k < K; ++k)
          for (size_t q = 0; q < pairs; ++q) {
            const double v = res.recall_at(t, k, as[q], ms[q]);
            if (v > -1) buf.push_back(v);
          }
      }
    }
    return buf.empty() ? -1.0 : numpy_mean(buf.data(), buf.size());
  };
  if (M >= 3) {
    const int m0 = p.max_dets[0], m1 = p.max_dets[1], m2 = p.max_dets[2];
    auto& st = res.stats;
    st[0] = summarize(true, 0, true, "all", 100);
    st[1] = summarize(true, .5, false, "all", m2);
    st[2] = summarize(true, .75, false, "all", m2);
    st[3] = summarize(true, 0, true, "small", m2);
    st[4] = summarize(true, 0, true, "medium", m2);
    st[5] = summarize(true, 0, true, "large", m2);
    st[6] = summarize(false, 0, true, "all", m0);
    st[7] = summarize(false, 0, true, "all", m1);
    st[8] = summarize(false, 0, true, "all", m2);
    st[9] = summarize(false, 0, true, "small", m2);
    st[10] = summarize(false, 0, true, "medium", m2);
    st[11] = summarize(false, 0, true, "large", m2);
  } else {
    res.stats.fill(-1);
  }

  // detectron2: precision[:, :, k, 0, -1], the entries > -1, mean (NaN when none)
  res.per_category_ap.resize(K);
  for (size_t k = 0; k < K; ++k) {
    buf.clear();
    for (size_t t = 0; t < T; ++t)
      for (size_t r = 0; r < R; ++r)
        if (double v = res.precision_at(t, r, k, 0, M - 1); v > -1) buf.push_back(v);
    res.per_category_ap[k] = numpy_mean(buf.data(), buf.size());
  }
  return res;
}

const std::array<const char*, 12>& stat_names() {
  static const std::array<const char*, 12> n = {"AP",  "AP50", "AP75",  "APs", "APm", "APl",
                                                "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"};
  return n;
}

std::string format_summary(const EvalResult& r) {
  const EvalParams& p = r.params;
  std::string out;
  char iou_all[64], line[256];
  std::snprintf(iou_all, sizeof iou_all, "%0.2f:%0.2f", p.iou_thrs.front(), p.iou_thrs.back());
  auto add = [&](bool ap, const char* iou, const char* area, int max_dets, double v) {
    // ' {:<18} {} @[ IoU={:<9} | area={:>6s} | maxDets={:>3d} ] = {:0.3f}'
    std::snprintf(line, sizeof line, " %-18s %s @[ IoU=%-9s | area=%6s | maxDets=%3d ] = %0.3f\n",
                  ap ? "Average Precision" : "Average Recall", ap ? "(AP)" : "(AR)", iou, area, max_dets, v);
    out += line;
  };
  if (p.max_dets.size() < 3) return out;
  const int m0 = p.max_dets[0], m1 = p.max_dets[1], m2 = p.max_dets[2];
  const auto& s = r.stats;
  add(true, iou_all, "all", 100, s[0]);
  add(true, "0.50", "all", m2, s[1]);
  add(true, "0.75", "all", m2, s[2]);
  add(true, iou_all, "small", m2, s[3]);
  add(true, iou_all, "medium", m2, s[4]);
  add(true, iou_all, "large", m2, s[5]);
  add(false, iou_all, "all", m0, s[6]);
  add(false, iou_all, "all", m1, s[7]);
  add(false, iou_all, "all", m2, s[8]);
  add(false, iou_all, "small", m2, s[9]);
  add(false, iou_all, "medium", m2, s[10]);
  add(false, iou_all, "large", m2, s[11]);
  return out;
}

namespace {

void put_number(std::string& out, double v) {
  char b[32];
  if (!std::isfinite(v)) v = 0;  // json has no NaN / inf
  auto [end, ec] = std::to_chars(b, b + sizeof b, v);
  out.append(b, end);
}

void put_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;  // RLE strings hold characters 48..111 only
  }
  out += '"';
}

}  // namespace

std::string results_json(const std::vector<Detection>& dets) {
  std::string out = "[";
  for (size_t i = 0; i < dets.size(); ++i) {
    const Detection& d = dets[i];
    out += i ? ",\n{" : "{";
    out += "\"image_id\": " + std::to_string(d.image_id) + ", \"category_id\": " + std::to_string(d.category_id);
    out += ", \"bbox\": [";
    for (size_t j = 0; j < 4; ++j) {
      if (j) out += ", ";
      put_number(out, d.bbox[j]);
    }
    out += "], \"score\": ";
    put_number(out, d.score);
    if (d.has_mask) {
      out += ", \"segmentation\": {\"size\": [" + std::to_string(d.mask.h) + ", " + std::to_string(d.mask.w) +
             "], \"counts\": ";
      put_json_string(out, rle_to_string(d.mask));
      out += "}";
    }
    out += "}";
  }
  out += "]\n";
  return out;
}

void write_results_json(const std::string& path, const std::vector<Detection>& dets) {
  const std::string text = results_json(dets);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f || !f.write(text.data(), std::streamsize(text.size())) || !f.flush())
    throw UserError(fmt::format("'{}': cannot write the results json", path));
}

}  // namespace imgtrain::coco
