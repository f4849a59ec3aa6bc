-- fixed_window.lua: at most `limit` units per aligned window, like limiter-core's
-- FixedWindow: a fixed length aligned on the Unix epoch (in microseconds), or a
-- calendar window (a local day, week, month or year) whose starts the server passes.
--
-- KEYS (one per level): a hash {i, c}: the window's number i (see window_span in
--   lib.lua: now // window, or a calendar window's start) and its count.
--   Absent, or another window's: nothing counted.
-- Level parameters (ARGV, after the kind): `fw`: limit, window (microseconds),
--   unused; `cw` (calendar): limit, then six consecutive window starts
--   (microseconds) around the server's clock.
-- Returns: nothing itself; chain.lua calls these functions.
-- Time: `now` in microseconds, from chain.lua (Redis TIME); a calendar window's
--   boundaries from the server's timezone rules, the window picked by Redis's time.

local fixed_window = { keys = 1 }

function fixed_window.load(lv, now)
  local s = redis.call('HMGET', lv.key, 'i', 'c')
  window_span(lv, now)
  lv.count = 0
  if s[1] and tonumber(s[1]) == lv.index then lv.count = tonumber(s[2]) end
end

function fixed_window.capacity(lv) return lv.p1 end

function fixed_window.remaining(lv, now)
  return math.max(0, lv.p1 - lv.count)
end

local function until_next_window(lv, now)
  return lv.start + lv.len - now
end

function fixed_window.retry_after(lv, now, cost)
  if lv.count + cost <= lv.p1 then return 0 end
  return until_next_window(lv, now)
end

function fixed_window.reset_after(lv, now)
  if lv.count == 0 then return 0 end
  return until_next_window(lv, now)
end

function fixed_window.charge(lv, now, stamp, cost)
  lv.count = math.min(lv.count + cost, max_charged(lv.p1))
  lv.dirty = true
end

function fixed_window.refund(lv, now, stamp, units)
  if window_of(lv, stamp) == 0 then
    lv.count = math.max(0, lv.count - units)
    lv.dirty = true
  end
end

function fixed_window.hold(lv, now, hold)
  return math.min(hold, until_next_window(lv, now))
end

function fixed_window.stamp(lv, now, hold) return now end

function fixed_window.save(lv, now)
  if lv.count <= 0 then
    redis.call('DEL', lv.key)
    return
  end
  redis.call('HSET', lv.key, 'i', int(lv.index), 'c', int(lv.count))
  expire_in(lv.key, until_next_window(lv, now), now)
end
