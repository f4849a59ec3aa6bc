-- token_bucket.lua: the token bucket as a theoretical arrival time (GCRA) on a
-- scaled time line, like limiter-core's TokenBucket: one microsecond is `a` scaled
-- units and one token is `p` of them, so refill is exact for any rate.
--
-- KEYS (one per level): a hash {w, f}; the bucket is full again at scaled time
--   w * a + f (w in microseconds, 0 <= f < a). Absent: a full bucket.
-- Level parameters (ARGV, after the kind `tb`): a, p, burst, with a and p reduced by
--   their common divisor so that burst * p stays below 2^52.
-- Returns: nothing itself; chain.lua calls these functions.
-- Time: `now` in microseconds, from chain.lua (Redis TIME).

local token_bucket = { keys = 1 }

function token_bucket.load(lv, now)
  local s = redis.call('HMGET', lv.key, 'w', 'f')
  local used = 0
  if s[1] then
    local w, f = tonumber(s[1]), tonumber(s[2])
    if w >= now then used = (w - now) * lv.p1 + f end
  end
  lv.used = used
  lv.cap = lv.p3 * lv.p2
end

function token_bucket.capacity(lv) return lv.p3 end

function token_bucket.remaining(lv, now)
  if lv.used >= lv.cap then return 0 end
  return idiv(lv.cap - lv.used, lv.p2)
end

function token_bucket.retry_after(lv, now, cost)
  local excess = lv.used + cost * lv.p2 - lv.cap
  if excess <= 0 then return 0 end
  return cdiv(excess, lv.p1)
end

function token_bucket.reset_after(lv, now)
  return cdiv(lv.used, lv.p1)
end

function token_bucket.charge(lv, now, stamp, cost)
  -- A debt is capped at ten allowances (as limiter-core's is); an older, deeper
  -- state is not moved back.
  local deepest = math.max(max_charged(lv.p3) * lv.p2, lv.used)
  lv.used = math.min(lv.used + cost * lv.p2, deepest, TWO52)
  lv.dirty = true
end

function token_bucket.refund(lv, now, stamp, units)
  lv.used = math.max(0, lv.used - math.min(units * lv.p2, TWO52))
  lv.dirty = true
end

function token_bucket.hold(lv, now, hold) return hold end
function token_bucket.stamp(lv, now, hold) return now end

function token_bucket.save(lv, now)
  if lv.used <= 0 then
    redis.call('DEL', lv.key)
    return
  end
  local whole = idiv(lv.used, lv.p1)
  redis.call('HSET', lv.key, 'w', int(now + whole), 'f', int(lv.used - whole * lv.p1))
  expire_in(lv.key, token_bucket.reset_after(lv, now), now)
end
