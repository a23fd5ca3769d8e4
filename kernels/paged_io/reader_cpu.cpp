// The pager's reader pool (localmoe/paging/readers.py): C++ threads that read expert extents from the packed
// store into RAM slots with O_DIRECT preadv and check them against their xxh3_64, without the Python interpreter
// lock. Python submits a read (id, file, offset, bytes, slot address, checksum), demanded ones before guesses;
// the compute thread waits on one read only when it needs that expert (`pio_wait`, called through ctypes, which
// drops the interpreter lock), and collects what finished (`pio_reap`) when it next enters the pager. A reader
// takes the lock once per read to record it and take the next one.
//
// Before each read the file is stat()ed by path and compared with what Python opened (device, inode, size,
// mtime): a deleted or replaced store file is reported, not read. A result is a code with a detail (below);
// Python turns it into the error naming the file and extent (localmoe/paging/disk.py `DiskBackend.failure`).
// xxhash.h is xxHash 0.8.3 by Yann Collet, BSD 2-Clause (XXHASH_LICENSE beside it).
#include <errno.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#define XXH_INLINE_ALL
#include "xxhash.h"

namespace {

// Result codes (localmoe/paging/readers.py mirrors them).
enum : int64_t { kOk = 0, kShort = 1, kChecksum = 2, kErrno = 3, kDeleted = 4, kReplaced = 5, kModified = 6 };

struct File {
  int fd;
  std::string path;
  int64_t dev, ino, size, mtime_ns;
};

struct Read {
  int64_t id, file, offset, nbytes;
  uint8_t* dest;
  uint64_t checksum;
  int verify;
};

struct Done {
  int64_t id, code, detail;
};

struct State {
  std::mutex mu;
  std::condition_variable work, done;  // a read queued (or closing) / a read finished
  std::vector<File> files;
  std::deque<Read> urgent, later;      // demanded reads first, then guesses (best first)
  std::unordered_map<int64_t, int> pending;  // queued or being read
  std::vector<Done> finished;          // not yet reaped
  int inflight = 0, paused = 0;
  bool closed = false;
  double busy = 0.0;                   // seconds with at least one read in flight
  std::chrono::steady_clock::time_point since;
};

Done read_one(const File& f, const Read& r) {
  struct stat st;
  if (stat(f.path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {r.id, kDeleted, 0};
    return {r.id, kErrno, errno};
  }
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (static_cast<int64_t>(st.st_dev) != f.dev || static_cast<int64_t>(st.st_ino) != f.ino)
    return {r.id, kReplaced, 0};
  if (static_cast<int64_t>(st.st_size) != f.size || mtime != f.mtime_ns) return {r.id, kModified, 0};
  int64_t got = 0;
  while (got < r.nbytes) {
    struct iovec v = {r.dest + got, static_cast<size_t>(r.nbytes - got)};
    const ssize_t n = preadv(f.fd, &v, 1, r.offset + got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return {r.id, kErrno, errno};
    }
    if (n == 0) return {r.id, kShort, got};
    got += n;
  }
  if (r.verify && XXH3_64bits(r.dest, static_cast<size_t>(r.nbytes)) != r.checksum) return {r.id, kChecksum, 0};
  return {r.id, kOk, r.nbytes};
}

// Takes the next read (demanded first) into `out` (lock held); false when closing.
bool take(State& s, std::unique_lock<std::mutex>& lk, Read& out) {
  s.work.wait(lk, [&] { return s.closed || (!s.paused && (!s.urgent.empty() || !s.later.empty())); });
  if (s.closed) return false;
  std::deque<Read>& q = s.urgent.empty() ? s.later : s.urgent;
  out = q.front();
  q.pop_front();
  if (s.inflight++ == 0) s.since = std::chrono::steady_clock::now();
  return true;
}

void reader(std::shared_ptr<State> s) {
  std::unique_lock<std::mutex> lk(s->mu);
  Read r;
  while (take(*s, lk, r)) {
    const File f = s->files[r.file];
    lk.unlock();
    const Done d = read_one(f, r);
    lk.lock();  // once per read: record it, then take the next
    if (--s->inflight == 0)
      s->busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - s->since).count();
    s->pending.erase(r.id);
    s->finished.push_back(d);
    s->done.notify_all();
  }
}

struct Pool {
  std::shared_ptr<State> state = std::make_shared<State>();
  int threads = 0, started = 0;  // readers start as reads come, up to `threads`
};

}  // namespace

extern "C" {

// A pool of up to `threads` readers, started as reads are submitted (they live until pio_close; each holds the
// state, so a read still hung at close ends on its own). Submit, cancel and close from one thread at a time.
void* pio_open(int threads) {
  auto* pool = new Pool();
  pool->threads = threads;
  return pool;
}

// Registers an open file (fd and the identity Python saw at open); returns its index for pio_submit.
int64_t pio_file(void* p, int fd, const char* path, int64_t dev, int64_t ino, int64_t size, int64_t mtime_ns) {
  State& s = *static_cast<Pool*>(p)->state;
  std::lock_guard<std::mutex> lk(s.mu);
  s.files.push_back({fd, path, dev, ino, size, mtime_ns});
  return static_cast<int64_t>(s.files.size()) - 1;
}

void pio_submit(void* p, int64_t id, int64_t file, int64_t offset, int64_t nbytes, void* dest, uint64_t checksum,
                int verify, int urgent) {
  auto* pool = static_cast<Pool*>(p);
  State& s = *pool->state;
  if (pool->started < pool->threads) {
    std::thread(reader, pool->state).detach();
    ++pool->started;
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    (urgent ? s.urgent : s.later).push_back({id, file, offset, nbytes, static_cast<uint8_t*>(dest), checksum, verify});
    s.pending[id] = 1;
  }
  s.work.notify_one();
}

// Drops read `id` if no reader took it yet: returns 1 (it is never read nor reported), else 0.
int pio_cancel(void* p, int64_t id) {
  State& s = *static_cast<Pool*>(p)->state;
  std::lock_guard<std::mutex> lk(s.mu);
  for (std::deque<Read>* q : {&s.later, &s.urgent}) {
    for (auto it = q->begin(); it != q->end(); ++it) {
      if (it->id == id) {
        q->erase(it);
        s.pending.erase(id);
        return 1;
      }
    }
  }
  return 0;
}

// Waits up to `timeout` seconds until read `id` is no longer queued or being read; returns 1 if so, 0 on timeout.
int pio_wait(void* p, int64_t id, double timeout) {
  State& s = *static_cast<Pool*>(p)->state;
  std::unique_lock<std::mutex> lk(s.mu);
  return s.done.wait_for(lk, std::chrono::duration<double>(timeout), [&] { return !s.pending.count(id); }) ? 1 : 0;
}

// Waits up to `timeout` seconds until some read finished that was not reaped; returns 1 if so.
int pio_wait_any(void* p, double timeout) {
  State& s = *static_cast<Pool*>(p)->state;
  std::unique_lock<std::mutex> lk(s.mu);
  return s.done.wait_for(lk, std::chrono::duration<double>(timeout), [&] { return !s.finished.empty(); }) ? 1 : 0;
}

// Moves up to `cap` finished reads into out (id, code, detail triples), oldest first; returns how many.
int64_t pio_reap(void* p, int64_t* out, int64_t cap) {
  State& s = *static_cast<Pool*>(p)->state;
  std::lock_guard<std::mutex> lk(s.mu);
  const int64_t n = std::min<int64_t>(cap, static_cast<int64_t>(s.finished.size()));
  for (int64_t i = 0; i < n; ++i) {
    out[3 * i] = s.finished[i].id;
    out[3 * i + 1] = s.finished[i].code;
    out[3 * i + 2] = s.finished[i].detail;
  }
  s.finished.erase(s.finished.begin(), s.finished.begin() + n);
  return n;
}

// Seconds with at least one read in flight, since the pool opened (the read in flight counted up to now).
double pio_busy(void* p) {
  State& s = *static_cast<Pool*>(p)->state;
  std::lock_guard<std::mutex> lk(s.mu);
  double busy = s.busy;
  if (s.inflight) busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - s.since).count();
  return busy;
}

// Tests: while paused no reader takes a queued read (pause 1 / resume 0).
void pio_pause(void* p, int paused) {
  State& s = *static_cast<Pool*>(p)->state;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.paused = paused;
  }
  s.work.notify_all();
}

// Drops the queued reads and lets the readers end; waits up to `timeout` seconds for the reads in flight (their
// slots' memory must outlive them) and returns 1 if none is left. The pool object stays allocated (a few bytes),
// so a waiter racing with the close is safe: it finds no read pending.
int pio_close(void* p, double timeout) {
  State& s = *static_cast<Pool*>(p)->state;
  std::unique_lock<std::mutex> lk(s.mu);
  s.closed = true;
  s.urgent.clear();
  s.later.clear();
  s.pending.clear();
  s.work.notify_all();
  s.done.notify_all();
  return s.done.wait_for(lk, std::chrono::duration<double>(timeout), [&] { return s.inflight == 0; }) ? 1 : 0;
}

}  // extern "C"
