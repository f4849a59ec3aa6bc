-- sliding_log.lua: at most `limit` units in any interval (now - window, now], like
-- limiter-core's SlidingLog. Entries are (stamp, units) with unique stamps; when a
-- log holds `limit` entries, a new charge merges into the newest one (at the later
-- stamp), so memory per key is bounded by the limit. A lease grant is stamped at the
-- end of its hold (it may be spent until then), which keeps the log exact.
--
-- KEYS (two per level): a hash (field `n`: the units logged; field "<stamp>": that
--   entry's units) and a sorted set of the stamps (member and score: the stamp in
--   microseconds). Absent: an empty log.
-- Level parameters (ARGV, after the kind `sl`): limit, window (microseconds), unused.
-- Returns: nothing itself; chain.lua calls these functions.
-- Time: `now` in microseconds, from chain.lua (Redis TIME).

local sliding_log = { keys = 2 }

function sliding_log.load(lv, now)
  -- Entries at or before now - window are out of every future interval: drop them.
  local cutoff = int(now - lv.p2)
  local dead = redis.call('ZRANGEBYSCORE', lv.log, '-inf', cutoff)
  local total = tonumber(redis.call('HGET', lv.key, 'n') or '0')
  if #dead > 0 then
    local gone = 0
    for _, m in ipairs(dead) do
      gone = gone + tonumber(redis.call('HGET', lv.key, m) or '0')
      redis.call('HDEL', lv.key, m)
    end
    redis.call('ZREMRANGEBYSCORE', lv.log, '-inf', cutoff)
    total = math.max(0, total - gone)
    lv.dirty = true
  end
  lv.total = total
end

function sliding_log.capacity(lv) return lv.p1 end

function sliding_log.remaining(lv, now)
  return math.max(0, lv.p1 - lv.total)
end

function sliding_log.retry_after(lv, now, cost)
  local excess = lv.total + cost - lv.p1
  if excess <= 0 then return 0 end
  local live = redis.call('ZRANGEBYSCORE', lv.log, '(' .. int(now - lv.p2), '+inf')
  local freed = 0
  for _, m in ipairs(live) do
    freed = freed + tonumber(redis.call('HGET', lv.key, m) or '0')
    if freed >= excess then return math.max(0, tonumber(m) + lv.p2 - now) end
  end
  return lv.p2
end

local function newest(lv)
  local last = redis.call('ZRANGE', lv.log, -1, -1)
  if last[1] then return tonumber(last[1]) end
  return nil
end

function sliding_log.reset_after(lv, now)
  local t = newest(lv)
  if t and t + lv.p2 > now then return t + lv.p2 - now end
  return 0
end

function sliding_log.charge(lv, now, stamp, cost)
  if cost <= 0 then return end
  -- Debt is capped in units (ten allowances, as limiter-core's), never in time: at
  -- the cap, the newest entry only counts for longer.
  cost = math.min(cost, max_charged(lv.p1) - lv.total)
  if cost <= 0 then
    local t = newest(lv)
    if t and stamp > t then
      local units = tonumber(redis.call('HGET', lv.key, int(t)) or '0')
      redis.call('HDEL', lv.key, int(t))
      redis.call('ZREM', lv.log, int(t))
      redis.call('HSET', lv.key, int(stamp), int(units))
      redis.call('ZADD', lv.log, int(stamp), int(stamp))
      lv.dirty = true
    end
    return
  end
  lv.total = math.min(lv.total + cost, TWO52)
  lv.dirty = true
  local m = int(stamp)
  if redis.call('HEXISTS', lv.key, m) == 1 then
    redis.call('HINCRBY', lv.key, m, cost)
    return
  end
  if redis.call('ZCARD', lv.log) >= lv.p1 then
    -- Full: the newest entry takes the units, at the later of the two stamps.
    local t = newest(lv)
    if stamp > t then
      local units = tonumber(redis.call('HGET', lv.key, int(t)) or '0')
      redis.call('HDEL', lv.key, int(t))
      redis.call('ZREM', lv.log, int(t))
      redis.call('HSET', lv.key, m, int(units + cost))
      redis.call('ZADD', lv.log, m, m)
    else
      redis.call('HINCRBY', lv.key, int(t), cost)
    end
    return
  end
  redis.call('HSET', lv.key, m, int(cost))
  redis.call('ZADD', lv.log, m, m)
end

function sliding_log.refund(lv, now, stamp, units)
  local m = int(stamp)
  local have = tonumber(redis.call('HGET', lv.key, m) or '0')
  if have <= 0 then return end
  local back = math.min(units, have)
  lv.total = math.max(0, lv.total - back)
  lv.dirty = true
  if back == have then
    redis.call('HDEL', lv.key, m)
    redis.call('ZREM', lv.log, m)
  else
    redis.call('HSET', lv.key, m, int(have - back))
  end
end

function sliding_log.hold(lv, now, hold)
  return math.min(hold, idiv(lv.p2, 40))
end

function sliding_log.stamp(lv, now, hold) return now + hold end

function sliding_log.save(lv, now)
  if lv.total <= 0 then
    redis.call('DEL', lv.key, lv.log)
    return
  end
  redis.call('HSET', lv.key, 'n', int(lv.total))
  local ttl = sliding_log.reset_after(lv, now)
  expire_in(lv.key, ttl, now)
  expire_in(lv.log, ttl, now)
end
