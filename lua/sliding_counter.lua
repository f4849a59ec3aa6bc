-- sliding_counter.lua: the current window's count plus the previous window's count
-- weighted by the part of it still inside the rolling window, like limiter-core's
-- SlidingCounter. Products such as prev * (window - elapsed) can pass 2^53, so they
-- go through muldiv (lib.lua), never through a rounded double.
--
-- KEYS (one per level): a hash {i, c, p}: window index i, its count c, and the
--   count p of window i - 1. Absent: nothing counted.
-- Level parameters (ARGV, after the kind `sc`): limit, window (microseconds), unused.
-- Returns: nothing itself; chain.lua calls these functions.
-- Time: `now` in microseconds, from chain.lua (Redis TIME).

local sliding_counter = { keys = 1 }

function sliding_counter.load(lv, now)
  local s = redis.call('HMGET', lv.key, 'i', 'c', 'p')
  local w = lv.p2
  lv.index = idiv(now, w)
  lv.elapsed = now - lv.index * w
  lv.prev, lv.curr = 0, 0
  if s[1] then
    local i = tonumber(s[1])
    if i == lv.index then
      lv.prev, lv.curr = tonumber(s[3]), tonumber(s[2])
    elseif i + 1 == lv.index then
      lv.prev = tonumber(s[2])
    end
  end
end

function sliding_counter.capacity(lv) return lv.p1 end

-- floor(room / window), which may be negative: limit - curr - ceil(prev * (w - e) / w).
local function room(lv)
  return lv.p1 - lv.curr - cmuldiv(lv.prev, lv.p2 - lv.elapsed, lv.p2)
end

function sliding_counter.remaining(lv, now)
  return math.max(0, room(lv))
end

-- The earliest elapsed time in a window at which `prev` weighs at most `budget`.
local function earliest_elapsed(lv, prev, budget)
  if prev == 0 then return 0 end
  return math.max(0, lv.p2 - muldiv(budget, lv.p2, prev))
end

function sliding_counter.retry_after(lv, now, cost)
  if room(lv) >= cost then return 0 end
  local w, limit = lv.p2, lv.p1
  local start = lv.index * w
  local budget = limit - (lv.curr + cost)
  if budget >= 0 then
    local e = math.max(earliest_elapsed(lv, lv.prev, budget), lv.elapsed)
    if e < w then return start + e - now end
  end
  local e = earliest_elapsed(lv, lv.curr, limit - cost)
  if e < w then return start + w + e - now end
  return start + 2 * w - now
end

function sliding_counter.reset_after(lv, now)
  local start = lv.index * lv.p2
  if lv.curr > 0 then return start + 2 * lv.p2 - now end
  if lv.prev > 0 then return start + lv.p2 - now end
  return 0
end

function sliding_counter.charge(lv, now, stamp, cost)
  lv.curr = math.min(lv.curr + cost, max_charged(lv.p1))
  lv.dirty = true
end

function sliding_counter.refund(lv, now, stamp, units)
  local g = idiv(stamp, lv.p2)
  if g == lv.index then
    lv.curr = math.max(0, lv.curr - units)
  elseif g + 1 == lv.index then
    lv.prev = math.max(0, lv.prev - units)
  else
    return
  end
  lv.dirty = true
end

function sliding_counter.hold(lv, now, hold)
  return math.min(hold, lv.p2 - now % lv.p2)
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
