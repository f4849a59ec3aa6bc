-- sliding_counter.lua: the current window's count plus the previous window's count
-- weighted by the part of it still inside the rolling window, like limiter-core's
-- SlidingCounter. With the current window of length L, elapsed e, and the previous
-- one of length P, the previous count weighs min(P, L - e) / P (a fixed window:
-- (W - e) / W). Products such as prev * (L - e) can pass 2^53, so they go through
-- muldiv (lib.lua), never through a rounded double.
--
-- KEYS (one per level): a hash {i, c, p}: the window's number i (see window_span in
--   lib.lua), its count c, and the count p of the window before. Absent: nothing
--   counted.
-- Level parameters (ARGV, after the kind): `sc`: limit, window (microseconds),
--   unused; `cc` (calendar): limit, then six consecutive window starts
--   (microseconds) around the server's clock.
-- Returns: nothing itself; chain.lua calls these functions.
-- Time: `now` in microseconds, from chain.lua (Redis TIME); a calendar window's
--   boundaries from the server's timezone rules, the window picked by Redis's time.

local sliding_counter = { keys = 1 }

function sliding_counter.load(lv, now)
  local s = redis.call('HMGET', lv.key, 'i', 'c', 'p')
  window_span(lv, now)
  lv.elapsed = now - lv.start
  lv.prev, lv.curr = 0, 0
  if s[1] then
    local i = tonumber(s[1])
    if i == lv.index then
      lv.prev, lv.curr = tonumber(s[3]), tonumber(s[2])
    elseif i == lv.prev_index then
      lv.prev = tonumber(s[2])
    end
  end
end

function sliding_counter.capacity(lv) return lv.p1 end

-- floor(room / P), which may be negative: limit - curr - ceil(prev * o / P), with o
-- the part of the previous window the rolling window still covers.
local function room(lv)
  local o = math.min(lv.prev_len, lv.len - lv.elapsed)
  return lv.p1 - lv.curr - cmuldiv(lv.prev, o, lv.prev_len)
end

function sliding_counter.remaining(lv, now)
  return math.max(0, room(lv))
end

-- The earliest elapsed time in a window of length `len` after one of length
-- `prev_len` holding `prev` units, at which those weigh at most `budget`.
local function earliest_elapsed(prev, prev_len, len, budget)
  if prev == 0 then return 0 end
  local slack = muldiv(budget, prev_len, prev)
  if slack >= prev_len then return 0 end
  return math.max(0, len - slack)
end

function sliding_counter.retry_after(lv, now, cost)
  if room(lv) >= cost then return 0 end
  local limit, start, len = lv.p1, lv.start, lv.len
  local budget = limit - (lv.curr + cost)
  if budget >= 0 then
    local e = math.max(earliest_elapsed(lv.prev, lv.prev_len, len, budget), lv.elapsed)
    if e < len then return start + e - now end
  end
  local nx = lv.next_len
  local e = earliest_elapsed(lv.curr, len, nx, limit - cost)
  if e < nx then return start + len + e - now end
  return start + len + nx - now
end

function sliding_counter.reset_after(lv, now)
  local last = lv.start + lv.len
  if lv.curr > 0 then return last + lv.next_len - now end
  if lv.prev > 0 then return last - now end
  return 0
end

function sliding_counter.charge(lv, now, stamp, cost)
  lv.curr = math.min(lv.curr + cost, max_charged(lv.p1))
  lv.dirty = true
end

function sliding_counter.refund(lv, now, stamp, units)
  local w = window_of(lv, stamp)
  if w == 0 then
    lv.curr = math.max(0, lv.curr - units)
  elseif w == 1 then
    lv.prev = math.max(0, lv.prev - units)
  else
    return
  end
  lv.dirty = true
end

function sliding_counter.hold(lv, now, hold)
  return math.min(hold, lv.start + lv.len - now)
end

function sliding_counter.stamp(lv, now, hold) return now end

function sliding_counter.save(lv, now)
  if lv.curr <= 0 and lv.prev <= 0 then
    redis.call('DEL', lv.key)
    return
  end
  redis.call('HSET', lv.key, 'i', int(lv.index), 'c', int(lv.curr), 'p', int(lv.prev))
  expire_in(lv.key, sliding_counter.reset_after(lv, now), now)
end
